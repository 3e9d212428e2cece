"""Block layout and per-block math shared by the forward and backward loops."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..common import dropout as dropout_lib
from ..common import blocking, segments
from ..common.blocking import BlockGrid, pad_axis
from ..common.mask import tile_allowed
from ..common.spec import AttentionSpec, Operands
from .config import BlockSizes, XlaConfig


@dataclasses.dataclass(frozen=True)
class Layout(BlockGrid):
  """Static block geometry of one call."""

  spec: AttentionSpec = None
  compute_dtype: Any = None  # matmul operands
  acc_dtype: Any = None  # accumulation, softmax statistics, bias
  precision: Any = None

  @property
  def splits_rows(self) -> bool:
    """Edge blocks that only half of a q block's rows reach run at half height."""
    return self.block_q % 2 == 0

  def halved(self) -> "Layout":
    """The same grid with half-height q blocks: block ``2i`` (``2i + 1``) is the
    top (bottom) half of block ``i``."""
    return dataclasses.replace(self, block_q=self.block_q // 2)

  def _half_reach(self) -> np.ndarray:
    """``[2, nq, nk]`` bool: whether the top (0) / bottom (1) half of q block i
    reaches kv block j through the band."""
    reach = blocking.kv_block_reach(self.spec.band, self.block_q // 2, self.block_kv,
                                    2 * self.num_q_blocks, self.num_kv_blocks)
    return reach.reshape(self.num_q_blocks, 2, self.num_kv_blocks).transpose(1, 0, 2)

  def split_ranges(self, over_kv: bool) -> tuple[np.ndarray, ...]:
    """Per outer block, ``(lo, t, a, b, h, hi)``: the inner blocks ``[lo, hi)``
    it reaches, of which ``[a, b)`` need no positional mask and the rest do.

    Of the masked ones, ``[lo, t)`` and ``[h, hi)`` are reached by one half of
    the q rows only and run at half height: walking kv blocks (``over_kv``) the
    band's left edge is seen by the top rows alone and its right edge (causal)
    by the bottom rows alone; walking q blocks it is the other way round.
    """
    band = self.spec.band
    # Walking q blocks, a kv block with padded keys masks every q block; padded
    # rows need no mask (their lse is +inf, so p = 0).
    table = (blocking.kv_block_table(band, self.block_q, self.block_kv) if over_kv
             else blocking.q_block_table(band, self.block_kv, self.block_q,
                                         strict_kv=True, strict_q=False))
    lo, a, b, hi = (table[:, c].copy() for c in range(4))
    reach = self._half_reach() if self.splits_rows else None
    if not over_kv and reach is not None:
      reach = reach[::-1].transpose(0, 2, 1)  # [first-run half, last-run half]
    t, h = lo.copy(), hi.copy()
    for o in range(len(lo)):
      run = slice(lo[o], hi[o])
      if reach is not None:
        # Leading blocks the second half does not reach and trailing ones the
        # first half does not reach (by convexity, one run at each end).
        second = np.flatnonzero(reach[1, o, run])
        first = np.flatnonzero(reach[0, o, run])
        t[o] = lo[o] + second[0] if second.size else hi[o]
        h[o] = lo[o] + first[-1] + 1 if first.size else lo[o]
      if a[o] == b[o]:  # no interior block: an empty run where the second half starts
        a[o] = b[o] = min(t[o], hi[o])
      # Interior blocks are reached by all rows, so only masked ones are halved.
      t[o] = min(t[o], a[o])
      h[o] = max(h[o], b[o])
    return lo, t, a, b, h, hi

  def shared_positional_mask(self, pairs) -> np.ndarray | None:
    """The band-and-tail mask ``[bq, bk]`` of blocks ``(i, j)`` in ``pairs`` when
    it is the same for all of them, else None. It depends on the block only
    through ``j * bk - i * bq`` (the band) and the key tail cutting block j; a
    constant mask costs XLA CPU almost nothing, one built from iotas and traced
    block indices ~10-20% of a step (measured 2026-11-22)."""
    spec = self.spec
    tail = self.seq_k_padded != spec.seq_k
    keys = {(j * self.block_kv - i * self.block_q,
             min(self.block_kv, spec.seq_k - j * self.block_kv) if tail else 0)
            for i, j in pairs}
    if len(keys) != 1:
      return None
    rows, cols = blocking.positions(*pairs[0], self.block_q, self.block_kv,
                                    dense=False)
    ok = np.ones((self.block_q, self.block_kv), bool)
    part = tile_allowed(spec.band, rows, cols, padded_keys=tail)
    return ok if part is None else ok & part


def make_layout(spec: AttentionSpec, config: XlaConfig, blocks: BlockSizes) -> Layout:
  """The layout of one loop: ``blocks`` (``config.fwd`` or ``config.bwd``)."""
  if config.compute_dtype is not None:
    dtype = jnp.dtype(config.compute_dtype)
  elif spec.dtype == "float64":
    dtype = jnp.dtype(jnp.float64)
  else:
    # bf16/fp16 matmuls are emulated on CPU: upcasting once is faster and exact.
    dtype = jnp.dtype(jnp.float32)
  # Exact fp32 products (no TF32/bf16 passes on accelerators).
  precision = jax.lax.Precision.HIGHEST if dtype.itemsize >= 4 else None
  acc = jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)
  return Layout(band=spec.band, block_q=min(blocks.block_q, spec.seq_q),
                block_kv=min(blocks.block_kv, spec.seq_k), spec=spec,
                compute_dtype=dtype, acc_dtype=acc, precision=precision)


class Prepared(NamedTuple):
  """Operands in the loops' layout: head-major, grouped by kv head, padded."""

  q: Any  # [B, Hkv, G, Sqp, D]
  k: Any  # [B, Hkv, Skp, D]
  v: Any  # [B, Hkv, Skp, Dv]
  bias: Any  # [Bb, Hkv|1, G|1, Sqp|1, Skp|1] or None
  mask: Any  # same shape rule, bool, or None
  q_ids: Any  # [B, Sqp] or None
  kv_ids: Any  # [B, Skp] or None
  seed: Any


def to_q_layout(x, lay: Layout):
  """[B, Sq, Hq, X] -> [B, Hkv, G, Sqp, X]: blocks along S are contiguous and each
  kv head's query group shares one batched matmul (no K/V repetition)."""
  s = lay.spec
  x = x.reshape(s.batch, s.seq_q, s.heads_kv, s.group_size, x.shape[-1])
  return pad_axis(jnp.transpose(x, (0, 2, 3, 1, 4)), 3, lay.seq_q_padded)


def from_q_layout(x, lay: Layout):
  s = lay.spec
  x = jnp.transpose(x[:, :, :, :s.seq_q], (0, 3, 1, 2, 4))
  return x.reshape(s.batch, s.seq_q, s.heads_q, x.shape[-1])


def to_kv_layout(x, lay: Layout):
  return pad_axis(jnp.transpose(x, (0, 2, 1, 3)), 2, lay.seq_k_padded)


def from_kv_layout(x, lay: Layout):
  return jnp.transpose(x[:, :, :lay.spec.seq_k], (0, 2, 1, 3))


def _to_grouped(x, lay: Layout, value=0):
  """Rank-4 broadcastable [Bb, Hb, Sqb, Skb] -> [Bb, Hkv|1, G|1, Sqp|1, Skp|1]."""
  s = lay.spec
  bb, hb, sqb, skb = x.shape
  x = x.reshape(bb, s.heads_kv, s.group_size, sqb, skb) if hb > 1 else x.reshape(
      bb, 1, 1, sqb, skb)
  if sqb > 1:
    x = pad_axis(x, 3, lay.seq_q_padded, value)
  if skb > 1:
    x = pad_axis(x, 4, lay.seq_k_padded, value)
  return x


def from_grouped(x, lay: Layout, shape4):
  """Inverse of the bias layout, for dbias."""
  bb, hb, sqb, skb = shape4
  x = x[..., :sqb if sqb > 1 else 1, :skb if skb > 1 else 1]
  return x.reshape(shape4)


def prepare(ops: Operands, lay: Layout) -> Prepared:
  dt = lay.compute_dtype
  q_ids = kv_ids = None
  if ops.q_segment_ids is not None:
    q_ids = pad_axis(ops.q_segment_ids, 1, lay.seq_q_padded)
    kv_ids = pad_axis(ops.kv_segment_ids, 1, lay.seq_k_padded)
  return Prepared(
      q=to_q_layout(ops.q.astype(dt), lay),
      k=to_kv_layout(ops.k.astype(dt), lay),
      v=to_kv_layout(ops.v.astype(dt), lay),
      bias=None if ops.bias is None else _to_grouped(ops.bias.astype(lay.acc_dtype),
                                                     lay),
      mask=None if ops.mask is None else _to_grouped(ops.mask, lay, False),
      q_ids=q_ids, kv_ids=kv_ids, seed=ops.dropout_seed)


def slice_q(x, lay: Layout, i, axis=3):
  return jax.lax.dynamic_slice_in_dim(x, i * lay.block_q, lay.block_q, axis)


def slice_kv(x, lay: Layout, j, axis=2):
  return jax.lax.dynamic_slice_in_dim(x, j * lay.block_kv, lay.block_kv, axis)


def slice_grouped(x, lay: Layout, i, j):
  """The (i, j) block of a bias/mask in grouped layout (size-1 dims stay 1)."""
  if x.shape[3] > 1:
    x = slice_q(x, lay, i, axis=3)
  if x.shape[4] > 1:
    x = slice_kv(x, lay, j, axis=4)
  return x


def keys_transposed(prep: Prepared):
  """K as ``[B, Hkv, D, Skp]``: the q.k^T products then read their right operand
  in the layout XLA CPU's dot wants; sliced from ``[.., Skp, D]`` each step it was
  transposed again every step (~10% of a 512 x 256 forward step, 2026-11-22)."""
  return jnp.swapaxes(prep.k, 2, 3)


def raw_logits(prep: Prepared, lay: Layout) -> bool:
  """Without bias or soft cap the softmax can run on unscaled products, the scale
  riding in the exp argument: the scaled tile is then never written out."""
  return prep.bias is None and lay.spec.logits_soft_cap is None


def finish_logits(s, prep: Prepared, lay: Layout, i, j, transposed: bool = False):
  """Scale, bias and soft cap of unscaled products ``s`` of block (i, j), in
  ``[.., G, q, kv]`` order or (``transposed``) ``[.., kv, G, q]``; also ``tanh`` of
  the capped logits (for the backward's chain rule) or None."""
  s = s * lay.spec.softmax_scale
  if prep.bias is not None:
    bias = slice_grouped(prep.bias, lay, i, j)
    s = s + (jnp.moveaxis(bias, 4, 2) if transposed else bias)
  t = None
  cap = lay.spec.logits_soft_cap
  if cap is not None:
    t = jnp.tanh(s / cap)
    s = cap * t
  return s, t


def allowed(prep: Prepared, lay: Layout, i, j, positional: bool = True):
  """Bool mask of block (i, j) (``mask.tile_allowed``), broadcastable to ``[B,
  Hkv, G, bq, bk]``, or None when everything is allowed. ``positional=False``
  leaves out the band and the key tail (for blocks that ``split_ranges`` marks
  interior); a numpy array is that mask, known ahead
  (``Layout.shared_positional_mask``)."""
  spec = lay.spec
  known = None
  if isinstance(positional, np.ndarray):  # the same for every block of a run
    known, positional = jnp.asarray(positional)[None, None, None], False
  rows = cols = q_ids = kv_ids = None
  if positional:
    rows, cols = (x[None, None, None] for x in blocking.positions(
        i, j, lay.block_q, lay.block_kv, dense=False))
  if prep.q_ids is not None:
    q_ids = slice_q(prep.q_ids, lay, i, axis=1)[:, None, None, :, None]
    kv_ids = slice_kv(prep.kv_ids, lay, j, axis=1)[:, None, None, None, :]
  ok = tile_allowed(spec.band, rows, cols,
                    padded_keys=lay.seq_k_padded != spec.seq_k, q_ids=q_ids,
                    kv_ids=kv_ids,
                    mask=None if prep.mask is None else slice_grouped(prep.mask, lay,
                                                                       i, j))
  if known is None:
    return ok
  return known if ok is None else known & ok


def dropout_keep(prep: Prepared, lay: Layout, i, j):
  """Keep-mask ``[B, Hkv, G, bq, bk]`` of ``dropout.keep`` at global indices; the
  row key is hashed once per row."""
  spec = lay.spec
  # Offsets of a block of a larger call (dropout.position_seed), else 0.
  seed, b0, h0, i0, j0 = dropout_lib.unpack_seed(prep.seed)
  b = b0 + jnp.arange(spec.batch)[:, None, None, None, None]
  h = h0 + (jnp.arange(spec.heads_kv)[:, None] * spec.group_size +
            jnp.arange(spec.group_size)[None, :])[None, :, :, None, None]
  rows, cols = blocking.positions(i, j, lay.block_q, lay.block_kv, dense=False)
  return dropout_lib.keep(seed, b, h, i0 + rows, j0 + cols, spec.dropout_rate)


def segment_ranges(prep: Prepared, lay: Layout):
  """Per-block ``(min, max)`` of segment ids (``segments.id_ranges``), ``([B, nq],
  [B, nk])`` pairs, or None without ids."""
  if prep.q_ids is None:
    return None
  spec = lay.spec
  return segments.id_ranges(prep.q_ids[:, :spec.seq_q], prep.kv_ids[:, :spec.seq_k],
                            lay.block_q, lay.block_kv, lay.num_q_blocks,
                            lay.num_kv_blocks)


def _visible(seg, lay: Layout, over_kv: bool):
  """Per outer block, the inner blocks ``[lo, hi)`` that the band and the ids of
  some batch element leave: the batch shares one loop, so it runs over the union
  (``lo = hi`` when no element sees any)."""
  lo, hi = segments.visible_blocks(*seg, lay.spec.band, lay.block_q, lay.block_kv,
                                   over_kv=over_kv)
  some = hi > lo
  n = lay.num_kv_blocks if over_kv else lay.num_q_blocks
  return jnp.where(some, lo, n).min(0), jnp.where(some, hi, 0).max(0)


def loop_blocks(step, prep: Prepared, lay: Layout, seg, outer, carry, *,
                over_kv: bool, halves=None):
  """Runs ``step(lay_q, i, j, carry, positional)`` over the blocks that outer
  block ``outer`` reaches: kv blocks ``j`` of q block ``outer`` (``over_kv``) or
  q blocks ``i`` of kv block ``outer``. ``lay_q`` is ``lay``, or ``lay.halved()``
  with ``i`` the index of a half-height block.

  The band and the key tail cut blocks only at both ends of each range, so
  loops over runs (masked, interior, masked) apply the positional mask only where
  it is needed, with no per-block branch. At the band's edges, blocks that only
  half of the q rows reach run at half height: half the products, with large
  enough blocks to stay efficient (the causal diagonal costs about 3/4 of its
  square instead of all of it). Walking kv blocks, the carry is the per-row state
  of the q block, so ``halves = (take, put)`` cuts it (``take(carry, half)``) and
  joins it back (``put(carry, sub, half)``). Blocks whose segment ranges cannot
  meet are skipped: each run is narrowed to the outer block's visible range
  (common/segments.py), and blocks inside it are skipped with a cond (segment
  ids are data).
  """
  ranges = lay.split_ranges(over_kv)
  visible = None if seg is None else _visible(seg, lay, over_kv)
  half_lay = lay.halved() if lay.splits_rows else None

  def run(lay_q, half, first, positional, c):
    start, stop = ranges[first], ranges[first + 1]
    if positional:
      pairs = [(o, n) if over_kv else (n, o)
               for o in range(len(start)) for n in range(start[o], stop[o])]
      pairs = [(i if half is None else 2 * i + half, j) for i, j in pairs]
      shared = lay_q.shared_positional_mask(pairs) if pairs else None
      positional = True if shared is None else shared

    def body(inner, c):
      i, j = (outer, inner) if over_kv else (inner, outer)
      i_q = i if half is None else 2 * i + half
      if seg is None:
        return step(lay_q, i_q, j, c, positional)
      return jax.lax.cond(segments.blocks_meet(*seg, i, j).any(),
                          lambda c: step(lay_q, i_q, j, c, positional),
                          lambda c: c, c)
    bounds = jnp.asarray(start)[outer], jnp.asarray(stop)[outer]
    if visible is not None:
      bounds = segments.narrow(bounds, visible[0][outer], visible[1][outer])
    return jax.lax.fori_loop(*bounds, body, c)

  def run_half(half, first, c):
    if over_kv:
      take, put = halves
      return put(c, run(half_lay, half, first, True, take(c, half)), half)
    return run(half_lay, half, first, True, c)

  # The first half-height run: top rows (kv walk) / bottom rows (q walk). Runs
  # that are empty for every outer block are left out of the program.
  top, bottom = (0, 1) if over_kv else (1, 0)
  if np.any(ranges[1] > ranges[0]):
    carry = run_half(top, 0, carry)
  carry = run(lay, None, 1, True, carry)
  carry = run(lay, None, 2, False, carry)
  carry = run(lay, None, 3, True, carry)
  if np.any(ranges[5] > ranges[4]):
    carry = run_half(bottom, 4, carry)
  return carry

