"""Static geometry and band block ranges of the Mosaic-GPU kernels.

Every range function works on Python ints and traced int32 scalars alike, so the
kernels compute their walks from the grid index and the tests check them on the
host; the band ranges themselves are common/blocking.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...common import blocking, dropout
from ...common.mask import Band
from .. import split_tail


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static shape of one call.

  Forward: ``block_q`` rows per compute warpgroup (a CTA owns two), ``block_kv``
  keys per pipeline step; Sq padded to ``2 * block_q``, Sk to ``block_kv``.
  dK/dV kernel: ``block_kv`` keys per compute warpgroup (a CTA owns two),
  ``block_q`` rows per pipeline step; Sk padded to ``2 * block_kv``, Sq to
  ``block_q``. D is padded to 64/128/256 in both. With ``shared_block`` (the
  backward above D = 128) a CTA of the dQ or dK/dV kernel owns one block, which
  both compute warpgroups share in two roles (bwd.py).
  """

  batch: int
  seq_q: int  # real lengths, for masking and ranges
  seq_k: int
  seq_q_padded: int
  seq_k_padded: int
  heads_q: int
  heads_kv: int
  head_dim: int  # padded, q/k and v alike
  band: Band
  softmax_scale: float
  soft_cap: float | None
  block_q: int
  block_kv: int
  num_stages: int
  dtype: str
  # Forward: CTAs of a persistent launch (each walks q tiles ``cta, cta + n, ...``);
  # 0 launches one CTA per q tile.
  persistent_ctas: int = 0
  # Persistent forward over a causal or window band or segment ids: each CTA
  # walks the tiles balanced_order gives it (in windows of consecutive tiles,
  # longest first; from the ids on the device) instead of every n-th.
  balanced: bool = False
  # Persistent full-band forward: run the last, partial round of tiles as key
  # ranges (split_tail.py) where the plan says it pays.
  split_tail: bool = False
  # Segment ids: the kernels take q and kv ids and a per-block table of the kv
  # (forward, dQ) or q (dK/dV) blocks the ids leave visible (segment_narrow).
  segments: bool = False
  # Contiguous segments (each id's positions one run): the own side's spans of
  # the other (common/segments.spans) replace its ids, the other side's ids do
  # not stream, and masked steps compare positions (mosaic.segment_operands).
  segment_spans: bool = False
  # Forward with an additive logit tile (a bias and/or a dense mask as 0 / -inf):
  # its dtype, and whether the operand has a batch and a head axis (else one
  # slice is broadcast).
  bias_dtype: str | None = None
  bias_batch: bool = True
  bias_heads: bool = True
  # Dropout: the kernels take dropout.kernel_seed(..., positions=True) and hash
  # each kept probability's global coordinates (dropout_row_keys, dropout_col_keys).
  dropout_rate: float = 0.0
  # Operands read in place (common/rows.py): the (batch, row) offsets of the
  # windows of q (and dO), K and V, shaped as above, in the arrays the kernels
  # get; (0, 0) where an array is its window.
  q_at: tuple = (0, 0)
  k_at: tuple = (0, 0)
  v_at: tuple = (0, 0)
  # Backward with an additive tile from a bias (not a mask alone): the dQ
  # kernel writes dS for dbias.
  bias_grad: bool = False
  # With bias_grad, a bias broadcast over the batch: the dQ kernel adds each
  # batch row's dS in fp32 into one zeroed ``[1, Hq, Sqp, Skp]`` array (TMA
  # reduce-adds), its CTAs batch-fastest so a tile's adds meet in L2.
  ds_batch_sum: bool = False
  # With bias_grad and no ds_batch_sum, dS summed outside the kernel (a bias
  # broadcast over the batch or heads) under a band with unreached tiles: the
  # dQ kernel writes only the tiles its walk reaches and leaves the rest
  # unwritten; the sum (mosaic/dbias_sum.py) reads only the reached ones.
  ds_reached_only: bool = False
  # Backward kernels: the two compute warpgroups share one block of rows (dQ)
  # or keys (dK/dV) in two roles (bwd.py). Above D = 128 one warpgroup's
  # registers hold one fp32 accumulator over the head dim, not two.
  shared_block: bool = False

  @property
  def blocks_per_cta(self) -> int:
    """Warpgroup blocks a CTA owns: two, or one shared with ``shared_block``."""
    return 1 if self.shared_block else 2

  @property
  def group(self) -> int:
    return self.heads_q // self.heads_kv

  @property
  def num_q_tiles(self) -> int:
    return self.seq_q_padded // (self.blocks_per_cta * self.block_q)

  @property
  def num_tiles(self) -> int:
    """Forward work items: q tiles of every (batch, q head)."""
    return self.num_q_tiles * self.heads_q * self.batch

  @property
  def num_ctas(self) -> int:
    if self.persistent_ctas:
      return min(self.persistent_ctas, self.num_tiles)
    return self.num_tiles

  @property
  def num_kv_tiles(self) -> int:
    return self.seq_k_padded // (self.blocks_per_cta * self.block_kv)


def additive_tiling(dtype, width: int):
  """Shared-memory transforms of an additive (bias / mask) tile ``width``
  elements wide: swizzled rows of up to 128 bytes (128 one-byte, 64 two-byte or
  32 four-byte elements); a narrower tile's whole rows (64 one-byte elements:
  64 bytes)."""
  item = jnp.dtype(dtype).itemsize
  row = min(width * item, 128)
  return plgpu.TilingTransform((8, row // item)), plgpu.SwizzleTransform(row)


def _window(ref, at, batch: int, rows: int):
  if ref is None or (tuple(at) == (0, 0) and tuple(ref.shape[:2]) == (batch, rows)):
    return ref
  return ref.at[pl.ds(at[0], batch), pl.ds(at[1], rows)]


def windows(g: Geometry, q, k, v, do=None):
  """The kernel's ``q, k, v, do`` refs as the windows at ``g``'s offsets (a
  ref view: the TMA copies add the offsets, nothing is copied)."""
  qs, ks = g.seq_q_padded, g.seq_k_padded
  return (_window(q, g.q_at, g.batch, qs), _window(k, g.k_at, g.batch, ks),
          _window(v, g.v_at, g.batch, ks), _window(do, g.q_at, g.batch, qs))


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def tile_coords(g: Geometry, t):
  """Forward work item ``t`` in ``[0, num_tiles)`` -> (batch, q head, q tile).
  q tiles vary fastest, so the CTAs running at once share K/V in L2, and run in
  reverse, so that the longest causal rows start first."""
  t = _i32(t)
  rest = lax.div(t, jnp.int32(g.num_q_tiles))
  tile = (g.num_q_tiles - 1) - lax.rem(t, jnp.int32(g.num_q_tiles))
  return lax.div(rest, jnp.int32(g.heads_q)), lax.rem(rest, jnp.int32(g.heads_q)), tile


def dropout_row_keys(seed, b, h, rows):
  """``dropout.row_key`` of local rows ``rows`` (padded indices, any shape) of
  batch ``b`` and query head ``h``, shifted by the offsets in ``seed`` (the
  int32 words of ``dropout.kernel_seed(..., positions=True)``: a shard's first
  batch and head, a ring hop's first row). Scalars read from a kernel's ref and
  host arrays alike: the backward computes its rows' keys in XLA, the forward
  in the kernel."""
  # Every term as a vector of the rows' shape (and in-kernel layout): Mosaic-GPU
  # (jax 0.11) cannot bitcast a scalar, which the hash does to its uint32 words.
  zero = rows * 0
  return dropout.row_key(zero + seed[0], zero + (b + seed[1]), zero + (h + seed[2]),
                         rows + seed[3])


def dropout_col_keys(seed, cols):
  """``dropout.col_key`` of local key positions ``cols``, shifted by the key
  offset in ``seed``."""
  return dropout.col_key(cols + seed[4])


# Row keys travel to the backward kernels in their fp32 row stats as two exact
# halves of 16 bits: a uint32 bitcast to fp32 would make NaN patterns (~0.4% of
# keys), which jax_debug_nans and checkify report as errors.
KEY_HALF = 1 << 16


def dropout_key_halves(keys):
  """uint32 row keys -> ``(high, low)`` 16-bit halves as exact fp32 values."""
  return ((keys >> 16).astype(jnp.float32), (keys & (KEY_HALF - 1)).astype(jnp.float32))


def dropout_keys_from_halves(high, low):
  """The inverse of :func:`dropout_key_halves` (in XLA or in a kernel)."""
  bits = lax.shift_left(high.astype(jnp.int32), 16) | low.astype(jnp.int32)
  return lax.bitcast_convert_type(bits, jnp.uint32)


def positions(n, tile_dim, start):
  """``start + [0, n)`` along dimension ``tile_dim`` of a kernel's WGMMA tile, in
  the layout that broadcasts into it."""
  return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=plgpu.Layout.WGMMA.reduce(
      1 - tile_dim)) + start


def dropout_keep(g: Geometry, row_keys, col_keys, row_dim: int):
  """Keep mask of a kernel tile whose rows (queries) lie along ``row_dim`` (1 in
  the dK/dV kernel's transposed tiles): the vectors of row keys and key terms
  broadcast against each other into ``dropout.keep_from_keys``."""
  shape = ((row_keys.shape[0], col_keys.shape[0]) if row_dim == 0 else
           (col_keys.shape[0], row_keys.shape[0]))
  return dropout.keep_from_keys(lax.broadcast_in_dim(row_keys, shape, [row_dim]),
                                lax.broadcast_in_dim(col_keys, shape, [1 - row_dim]),
                                g.dropout_rate, unsigned_compare=True)


def tail_plan(g: Geometry) -> split_tail.Tail | None:
  """The persistent forward's split of its last round of tiles along the keys, or
  None. Only for the full band, where every tile walks the same number of steps."""
  if not (g.split_tail and g.persistent_ctas and g.band.is_full):
    return None
  return split_tail.plan(g.num_tiles, g.num_ctas, g.seq_k_padded // g.block_kv)


def tile_steps(g: Geometry, visible=None):
  """The kv steps each forward tile ``t`` (:func:`tile_coords`) walks: host
  ints, or with ``visible`` (segment ids' ``[B, 4, Sqp / block_q]`` table of
  mosaic.segment_operands) an ``[num_tiles]`` int32 array computed on the
  device, since the ids are data."""
  if visible is None:
    with jax.ensure_compile_time_eval():  # host ints, also while a call is traced
      steps = []
      for tile in range(g.num_q_tiles):
        _, lo_c, hi_c = cta_block_ranges(g, tile)
        steps.append(int(hi_c) - int(lo_c))
    # t -> its q tile: tile_coords' reversed q tiles, fastest.
    return [steps[(g.num_q_tiles - 1) - t % g.num_q_tiles] for t in range(g.num_tiles)]

  def steps_of(t):
    b_idx, _, tile = tile_coords(g, t)
    narrow = lambda i: tuple(visible[b_idx, j, i] for j in range(4))
    _, lo_c, hi_c = cta_block_ranges(g, tile, narrow)
    return hi_c - lo_c

  return jax.vmap(steps_of)(jnp.arange(g.num_tiles, dtype=jnp.int32))


# Tiles are dealt in windows of this many rounds of consecutive tiles (a few
# heads' K and V), so the CTAs running at once share K and V in L2. Four rounds
# keep the loads within 3% of the mean on the causal and packed shapes of the
# tests, where two rounds left up to 13%.
WINDOW_ROUNDS = 4


def balanced_order(g: Geometry, visible=None):
  """The persistent forward's tiles per CTA, ``[num_ctas, 2 + rounds]`` int32:
  row ``c`` holds CTA ``c``'s tile count, then its tiles (indices for
  :func:`tile_coords`) in the order it runs them, padded with 0 (at least one
  padding column: the kernel reads an entry ahead).

  The tiles are cut into windows of ``WINDOW_ROUNDS * num_ctas`` consecutive
  tiles (a head's tiles follow each other); each window's tiles go longest
  first (a tile's cost: its walk's kv steps), one per CTA per round, every other
  round in reverse CTA order (a snake: a CTA that took a long tile takes a short
  one next; the pattern flips every window, so no CTA gains from it every
  time). Uneven band tiles end together, and the CTAs running at once stay in
  one window's heads.

  A band alone gives the steps on the host (numpy, a constant of the program).
  Under segment ids (``visible``, see :func:`tile_steps`) they are known on the
  device only, which deals the tiles the same way."""
  most = g.seq_k_padded // g.block_kv  # no walk is longer
  if visible is None:
    return _deal(np.asarray(tile_steps(g), np.int32), g.num_ctas, most, np)
  return _deal(tile_steps(g, visible), g.num_ctas, most, jnp)


def _deal(steps, ctas: int, most: int, xp):
  """:func:`balanced_order`'s table from ``steps [num_tiles]`` (each at most
  ``most``) with ``xp`` (numpy or jax.numpy): each tile's rank in the order
  (window, longest first, tile), on the host from one sort, on the device
  from :func:`_window_ranks`; then :func:`_seat` puts rank ``p`` in its CTA's
  row. The counts depend on the tile count alone: host constants. No
  sequential loop, and on the device one scatter."""
  n = steps.shape[0]
  rounds = -(-n // ctas)
  if xp is not np:
    rank = _window_ranks(steps, WINDOW_ROUNDS * ctas, most)
  else:
    t = np.arange(n, dtype=np.int32)
    window = t // (WINDOW_ROUNDS * ctas)
    if -(-n // (WINDOW_ROUNDS * ctas)) * (most + 1) < 2**31:
      # One int32 key, window then longest first, in a stable sort.
      order = np.argsort(window * (most + 1) + (most - steps), stable=True)
    else:
      order = np.lexsort((t, -steps, window))
    rank = np.empty(n, np.int32)
    rank[order] = t
  base = np.zeros((ctas, rounds + 2), np.int32)
  # Only the last round is partial: its first n % ctas seats are taken.
  base[:, 0] = np.bincount(_seat(np.arange(n), ctas)[0], minlength=ctas)
  cta, col = _seat(rank, ctas)
  tiles = xp.arange(n, dtype=np.int32)
  if xp is np:
    base[cta, col] = tiles
    return base
  return jnp.asarray(base).at[cta, col].set(tiles, unique_indices=True)


def _seat(rank, ctas: int):
  """The (CTA, table column) of the tile ranked ``rank``: one tile per CTA per
  round, every other round in reverse CTA order (a snake), and the pattern
  flipped every window of ``WINDOW_ROUNDS`` rounds."""
  r, c = rank // ctas, rank % ctas
  flip = (r % 2) != ((r // WINDOW_ROUNDS) % 2)
  return (ctas - 1 - c) * flip + c * (1 - flip), 1 + r


def _window_ranks(steps, size: int, most: int):
  """Each tile's rank in the order (window of ``size`` consecutive tiles,
  longest first, tile) on the device, without a sort: the window's tiles that
  go before it (one fused compare and sum). On an H200 (2026-11-27, 2048
  tiles) an argsort of the same key took 13.9 us per call, the ranks about 2
  us. The comparisons grow as tiles x window size (528 on 132 SMs); XLA fuses
  them into the sum, and larger tile counts are not measured."""
  n = steps.shape[0]
  windows = -(-n // size)
  # Padding tiles rank after every real tile of the last window.
  key = jnp.full((windows * size,), most + 1, jnp.int32).at[:n].set(
      most - steps.astype(jnp.int32)).reshape(windows, size)
  i = jnp.arange(size, dtype=jnp.int32)
  mine, other = key[:, :, None], key[:, None, :]
  goes_before = (other < mine) | ((other == mine) & (i[None, None, :] < i[None, :, None]))
  rank = goes_before.sum(-1, dtype=jnp.int32) + (
      jnp.arange(windows, dtype=jnp.int32) * size)[:, None]
  return rank.reshape(-1)[:n]


def num_units(g: Geometry) -> int:
  """Forward work items: whole tiles, then the tail's (tile, key range) parts."""
  tail = tail_plan(g)
  return tail.units if tail else g.num_tiles


def tiles_of_cta(g: Geometry, cta):
  """How many work items CTA ``cta`` runs: ``cta, cta + num_ctas, ...``."""
  return lax.div(num_units(g) - _i32(cta) + (g.num_ctas - 1), jnp.int32(g.num_ctas))


def unit_tile(g: Geometry, u):
  """The tile index (for :func:`tile_coords`) of forward work item ``u``."""
  tail = tail_plan(g)
  return _i32(u) if tail is None else split_tail.unit(tail, _i32(u))[1]


def unit_walk(g: Geometry, u, seg=None):
  """Forward work item ``u`` -> ``(tile index t, whole, part, ranges, lo_c, hi_c)``:
  :func:`cta_block_ranges` of tile ``t`` cut to the item's key range. ``whole``
  is False for a tail part (``part`` of the tail's ``parts``; see
  :func:`tail_plan`), whose walk is the part's consecutive kv blocks. ``seg(b,
  i)``: the visible kv blocks ``(lo, hi)`` of batch ``b``'s warpgroup row block
  ``i`` under segment ids and the run among them that the ids do not mask,
  ``(lo, hi, one_lo, one_hi)`` (see :func:`segment_narrow`), or None."""
  tail = tail_plan(g)
  if tail is None:
    t = _i32(u)
    b_idx, _, tile = tile_coords(g, t)
    narrow = None if seg is None else (lambda i: seg(b_idx, i))
    return (t, jnp.bool_(True), _i32(0)) + cta_block_ranges(g, tile, narrow)
  whole, t, part = split_tail.unit(tail, _i32(u))
  ranges, lo_c, hi_c = cta_block_ranges(g, tile_coords(g, t)[2])
  # A whole tile is its own single part.
  k_lo, k_hi = split_tail.key_range(lo_c, hi_c, part, jnp.where(whole, 1, tail.parts))
  ranges = [tuple(_clamp(x, k_lo, k_hi) for x in rg) for rg in ranges]
  return t, whole, part, ranges, k_lo, k_hi


def walks_ahead(g: Geometry, n_local, unit, seg=None):
  """A persistent forward CTA's work items with their walks read one item
  ahead: ``(first, take)``. ``first()`` is the loop carry of item 0 (its
  first entry the item); ``take(it, carry)`` returns item ``it``'s walk (as
  :func:`unit_walk`'s) and the carry of item ``it + 1``.

  ``unit(i)`` (a balanced launch's table entry) and ``seg``'s visible-block
  table are scalar reads from global memory, each one L2 round trip that the
  compute warpgroups would otherwise wait for at every tile start, one after
  the other (the table entry, then the ids' blocks). Here item ``it + 2``'s
  entry and item ``it + 1``'s walk are read while item ``it`` runs; indices past
  the CTA's last item read its last one again (in range, never used)."""
  # Segment ids never take a split tail (mosaic.geometry); their walks carry
  # whole tiles.
  assert seg is None or tail_plan(g) is None
  last = n_local - 1
  fetch = lambda i: unit(jnp.minimum(i, last))

  def read(u):
    if seg is None:
      return ()
    t, _, _, ranges, lo_c, hi_c = unit_walk(g, u, seg)
    return t, ranges, lo_c, hi_c

  def first():
    u = fetch(0)
    return u, read(u), fetch(1)

  def take(it, carry):
    u, walk, u_next = carry
    if seg is None:
      walk = unit_walk(g, u)
    else:  # segment ids run without a split tail: whole tiles only
      t, ranges, lo_c, hi_c = walk
      walk = (t, jnp.bool_(True), _i32(0), ranges, lo_c, hi_c)
    return walk, (u_next, read(u_next), fetch(it + 2))

  return first, take


def wg_block_ranges(g: Geometry, r0):
  """``(lo, a, b, hi)`` kv blocks for rows ``[r0, r0 + block_q)``: blocks
  ``[lo, hi)`` are reached, ``[a, b)`` need no mask (``blocking.kv_block_range``).
  Empty rows give ``lo = hi``."""
  return blocking.kv_block_range(g.band, r0, g.block_q, g.block_kv)


def reached_tiles(g: Geometry) -> np.ndarray:
  """``bool [Sqp / block_q, Skp / block_kv]``: the tiles of a dQ warpgroup's
  walk (:func:`wg_block_ranges` of each row block) under the band alone."""
  return blocking.kv_block_reach(g.band, g.block_q, g.block_kv,
                                 g.seq_q_padded // g.block_q, g.seq_k_padded // g.block_kv)


def wg_q_ranges(g: Geometry, k0):
  """``(lo, a, b, hi)`` q blocks for keys ``[k0, k0 + block_kv)`` (the dK/dV
  kernel's transpose of :func:`wg_block_ranges`, ``blocking.q_block_range``):
  blocks ``[lo, hi)`` reach the keys, ``[a, b)`` need no band mask. Keys past Sk
  need no mask there: they are padding whose dK/dV rows are cut off."""
  return blocking.q_block_range(g.band, k0, g.block_kv, g.block_q, strict_q=False)


def segment_narrow(rg, seg):
  """A warpgroup's band ranges ``(lo, a, b, hi)`` cut to the blocks segment ids
  leave visible, ``seg = (lo, hi, one_lo, one_hi)``: blocks ``[one_lo, one_hi)``
  hold the warpgroup's own single id only, so only the band may mask there
  (with spans, segments.span_blocks: every row sees them whole)."""
  lo = jnp.maximum(rg[0], seg[0])
  hi = jnp.maximum(jnp.minimum(rg[3], seg[1]), lo)
  a = _clamp(jnp.maximum(rg[1], seg[2]), lo, hi)
  b = _clamp(jnp.minimum(rg[2], seg[3]), a, hi)
  return lo, a, b, hi


def band_walk(body, skip, carry, lo_c, ranges, hi_c):
  """A warpgroup's walk of steps ``[lo_c, hi_c)`` over the band's phases (the
  forward, dQ and dK/dV kernels alike): skip / masked / plain / masked / skip,
  ``ranges`` being its ``(lo, a, b, hi)``; ``body(s, carry, masked)`` runs the
  steps, ``skip(s, None)`` the others, which must still wait for the slot's data
  and release it so that barrier phases stay in step."""
  lo, a, b, hi = ranges
  lax.fori_loop(lo_c, lo, skip, None)
  carry = lax.fori_loop(lo, a, lambda s, c: body(s, c, True), carry)
  carry = lax.fori_loop(a, b, lambda s, c: body(s, c, False), carry)
  carry = lax.fori_loop(b, hi, lambda s, c: body(s, c, True), carry)
  lax.fori_loop(hi, hi_c, skip, None)
  return carry


def union_walk(rng):
  """Two warpgroups' ranges -> (ranges, lo_c, hi_c): the CTA walks ``[lo_c, hi_c)``,
  the union; an empty warpgroup's range collapses to ``lo_c`` so it walks every
  step as a skip."""
  nonempty = [x[3] > x[0] for x in rng]
  big = jnp.int32(2**30)
  lo_c = jnp.minimum(*(jnp.where(ne, x[0], big) for ne, x in zip(nonempty, rng)))
  hi_c = jnp.maximum(*(jnp.where(ne, x[3], 0) for ne, x in zip(nonempty, rng)))
  lo_c = jnp.where(nonempty[0] | nonempty[1], lo_c, 0)
  hi_c = jnp.maximum(hi_c, lo_c)
  rng = [tuple(jnp.where(ne, x, lo_c) for x in rg) for ne, rg in zip(nonempty, rng)]
  return rng, lo_c, hi_c


def _walk(ranges, tile, narrow, per_cta: int):
  """Warpgroup ``w`` owns block ``tile * per_cta + w`` (both own block ``tile``
  when ``per_cta`` is 1)."""
  own = [tile * per_cta + w % per_cta for w in (0, 1)]
  rng = [ranges(i) for i in own]
  if narrow is not None:
    rng = [segment_narrow(rg, narrow(i)) for i, rg in zip(own, rng)]
  return union_walk(rng)


def cta_block_ranges(g: Geometry, tile, narrow=None):
  """Forward and dQ: per warpgroup kv ranges of q tile ``tile`` and the CTA's
  walk; ``narrow(i)`` gives warpgroup row block ``i``'s visible kv blocks under
  segment ids (or None)."""
  return _walk(lambda i: wg_block_ranges(g, i * g.block_q), tile, narrow,
               g.blocks_per_cta)


def cta_q_ranges(g: Geometry, tile, narrow=None):
  """dK/dV: per warpgroup q ranges of kv tile ``tile`` and the CTA's walk;
  ``narrow(i)`` as in :func:`cta_block_ranges`, for warpgroup key block ``i``."""
  return _walk(lambda i: wg_q_ranges(g, i * g.block_kv), tile, narrow,
               g.blocks_per_cta)
