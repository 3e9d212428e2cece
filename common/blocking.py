"""Index math shared by every blockwise platform: padding (and the padded sizes
of the Triton-based kernels), block counts, the block ranges the band lets each
q block (or kv block) reach, and the global positions of a block's elements.

The range functions work on Python ints (and NumPy arrays of them), giving NumPy
values for tables built at trace time, and on traced int32 scalars or arrays,
giving traced values for kernels that compute their walks from a program index.
On traced values they use only ``lax.div`` on non-negative numbers, ``minimum``,
``maximum`` and ``where``, which every kernel lowering (Mosaic GPU and TPU,
Triton, XLA) provides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .launch import tile_size
from .mask import Band

# Kernels run the softmax in base 2 (exp2 is one instruction on GPUs): logits are
# scaled by LOG2E and a base-2 lse is turned back into a natural one by LN2.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def pad_axis(x, axis: int, size: int, value=0):
  """Pads ``axis`` of ``x`` at the end up to ``size`` (no-op if already there)."""
  extra = size - x.shape[axis]
  if extra <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def pad_broadcastable(x, seq_q_padded: int, seq_k_padded: int, value=0):
  """Pads the sequence dims of a rank-4 [Bb, Hb, Sqb, Skb] bias/mask where they
  are not broadcast (size 1)."""
  if x.shape[2] > 1:
    x = pad_axis(x, 2, seq_q_padded, value)
  if x.shape[3] > 1:
    x = pad_axis(x, 3, seq_k_padded, value)
  return x


def round_up(n: int, multiple: int) -> int:
  """``n`` rounded up to a multiple of ``multiple``."""
  return -(-n // multiple) * multiple


def shared_padding(kernels) -> tuple[int, int]:
  """``(pad_q, pad_k)``: the largest ``block_q`` and ``block_kv`` of
  ``kernels`` (the tile configs of one call's forward and backward kernels), so
  that sequences padded to their multiples serve every kernel."""
  return max(c.block_q for c in kernels), max(c.block_kv for c in kernels)


class PaddedLengths:
  """The padded sizes of the Triton-based kernels, as properties of a class with
  the attributes ``spec`` (an AttentionSpec), ``pad_q`` and ``pad_k``
  (:func:`shared_padding`): sequences rounded up to multiples of ``pad_q`` /
  ``pad_k``, head dims to powers of two of at least 16 (``launch.tile_size``,
  Triton's block shapes; zero padding adds nothing to q.k or to p.v)."""

  @property
  def seq_q_padded(self) -> int:
    return round_up(self.spec.seq_q, self.pad_q)

  @property
  def seq_k_padded(self) -> int:
    return round_up(self.spec.seq_k, self.pad_k)

  @property
  def head_dim_padded(self) -> int:
    return tile_size(self.spec.head_dim)

  @property
  def head_dim_v_padded(self) -> int:
    return tile_size(self.spec.head_dim_v)


class BlockRange(NamedTuple):
  """Inner blocks ``first <= first_full <= last_full_end <= last_end`` of one
  outer block: ``[first, last_end)`` are the blocks it reaches (any allowed
  pair), ``[first_full, last_full_end)`` those whose every pair is allowed, so
  they need no positional mask; ``(0, 0, 0, 0)`` when it reaches none."""

  first: object
  first_full: object
  last_full_end: object
  last_end: object


def _traced(x) -> bool:
  return isinstance(x, jax.Array)  # tracers are jax.Arrays too


def _ops(x):
  """``(where, minimum, maximum, div)`` for ``x``: NumPy's on host ints, else
  jnp/lax on int32 (``div`` of non-negative numbers only)."""
  if _traced(x):
    return (jnp.where, jnp.minimum, jnp.maximum,
            lambda a, b: jax.lax.div(a, jnp.int32(b)))
  return np.where, np.minimum, np.maximum, lambda a, b: a // b


def kv_block_range(band: Band, q_start, block_q: int, block_kv: int, *,
                   strict_q: bool = False, strict_kv: bool = True) -> BlockRange:
  """The kv blocks (``block_kv`` keys each) that rows ``[q_start, q_start +
  block_q)`` reach through ``band``, and those they see whole.

  Rows at or past ``band.seq_q`` and keys at or past ``band.seq_k`` are padding.
  Padding rows reach nothing and constrain nothing, so a block starting there
  reaches no key; with ``strict_q`` a q block holding padding rows has no full
  kv block (``first_full = last_full_end = last_end``). With ``strict_kv`` (the
  default) a kv block holding padding keys is never full; without, padding keys
  count as the band continued past Sk (for passes where they need no mask).

  ``q_start`` is a Python int, an int array (one range per entry) or a traced
  int32 scalar/array; the result is NumPy int32 or traced int32 alike.
  """
  traced = _traced(q_start)
  where, minimum, maximum, div = _ops(q_start)
  const = jnp.int32 if traced else np.int64
  q_start = (jnp.asarray(q_start, jnp.int32) if traced
             else np.asarray(q_start, np.int64))
  clip = lambda x, lo, hi: minimum(maximum(x, lo), hi)
  cdiv = lambda x, b: div(x + (b - 1), b)
  sq, sk, off, bk = band.seq_q, band.seq_k, band.offset, block_kv
  r0 = q_start
  r_last = minimum(r0 + block_q, sq) - 1
  # The first row's first key and the last row's end bound what the block reaches.
  lo_k = const(0) if band.left is None else maximum(r0 + off - band.left, 0)
  hi_k = const(sk) if band.right is None else clip(
      r_last + off + band.right + 1, 0, sk)
  empty = (hi_k <= lo_k) | (r0 >= sq)
  first = div(minimum(lo_k, sk), bk)
  last_end = maximum(cdiv(hi_k, bk), first)
  # Every row sees a whole kv block from the last row's first key up to the
  # first row's end, cut at Sk.
  full_lo = first if band.left is None else cdiv(
      maximum(r_last + off - band.left, 0), bk)
  first_full = clip(full_lo, first, last_end)
  if band.right is None:
    last_full_end = last_end if not strict_kv else clip(div(const(sk), bk),
                                                        first_full, last_end)
  else:
    end = r0 + off + band.right + 1
    end = clip(end, 0, sk) if strict_kv else maximum(end, 0)
    last_full_end = clip(div(end, bk), first_full, last_end)
  if strict_q:
    cut = r0 + block_q > sq
    first_full = where(cut, last_end, first_full)
    last_full_end = where(cut, last_end, last_full_end)
  out = (where(empty, const(0), x)
         for x in (first, first_full, last_full_end, last_end))
  if traced:
    return BlockRange(*(jnp.asarray(x, jnp.int32) for x in out))
  return BlockRange(*(np.asarray(x, np.int32) for x in out))


def transposed(band: Band) -> Band:
  """The band of keys over queries: key ``j`` sees query ``i`` iff ``i`` sees
  ``j`` (the aligned diagonal's offset changes sign, left and right swap)."""
  return Band(seq_q=band.seq_k, seq_k=band.seq_q, left=band.right, right=band.left)


def q_block_range(band: Band, k_start, block_kv: int, block_q: int, *,
                  strict_kv: bool = False, strict_q: bool = True) -> BlockRange:
  """The transpose of :func:`kv_block_range`, for passes over kv blocks: the q
  blocks (``block_q`` rows each) that reach keys ``[k_start, k_start +
  block_kv)``, and those whose every row sees every one of those keys. Padding
  keys reach nothing and constrain nothing; ``strict_kv``: a kv block holding
  them has no full q block. ``strict_q`` (default): a q block holding padding
  rows is never full; without, they count as the band continued past Sq."""
  return kv_block_range(transposed(band), k_start, block_kv, block_q,
                        strict_q=strict_kv, strict_kv=strict_q)


def kv_block_table(band: Band, block_q: int, block_kv: int,
                   num_q_blocks: int | None = None, **kw) -> np.ndarray:
  """``int32 [num_q_blocks, 4]``: :func:`kv_block_range` of every q block
  (default: the blocks holding real rows)."""
  n = -(-band.seq_q // block_q) if num_q_blocks is None else num_q_blocks
  return np.stack(kv_block_range(band, np.arange(n) * block_q, block_q, block_kv,
                                 **kw), -1).reshape(n, 4)


def kv_block_reach(band: Band, block_q: int, block_kv: int,
                   num_q_blocks: int | None = None,
                   num_kv_blocks: int | None = None) -> np.ndarray:
  """``bool [num_q_blocks, num_kv_blocks]``: whether q block ``i`` reaches kv
  block ``j`` through ``band`` (:func:`kv_block_table`'s ``[lo, hi)``; default
  counts: the blocks holding real rows and keys)."""
  t = kv_block_table(band, block_q, block_kv, num_q_blocks)
  nk = -(-band.seq_k // block_kv) if num_kv_blocks is None else num_kv_blocks
  j = np.arange(nk)
  return (t[:, :1] <= j) & (j < t[:, 3:])


def q_block_table(band: Band, block_kv: int, block_q: int,
                  num_kv_blocks: int | None = None, **kw) -> np.ndarray:
  """``int32 [num_kv_blocks, 4]``: :func:`q_block_range` of every kv block."""
  n = -(-band.seq_k // block_kv) if num_kv_blocks is None else num_kv_blocks
  return np.stack(q_block_range(band, np.arange(n) * block_kv, block_kv, block_q,
                                **kw), -1).reshape(n, 4)


def positions(i, j, block_q: int, block_kv: int, *, dense: bool = True):
  """Global row and key indices of block ``(i, j)``: ``[bq, bk]`` int32 each
  (``dense``; 2-D iotas, which Mosaic TPU needs) or ``[bq, 1]`` and ``[1, bk]``.
  NumPy for host ints with ``dense=False``."""
  if not dense:
    if not (_traced(i) or _traced(j)):
      return (i * block_q + np.arange(block_q)[:, None],
              j * block_kv + np.arange(block_kv)[None, :])
    return (i * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None],
            j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)[None, :])
  iota = lambda d: jax.lax.broadcasted_iota(jnp.int32, (block_q, block_kv), d)
  return i * block_q + iota(0), j * block_kv + iota(1)


@dataclasses.dataclass(frozen=True)
class BlockGrid:
  """Square tiling of a (Sq, Sk) problem into ``block_q x block_kv`` blocks."""

  band: Band
  block_q: int
  block_kv: int

  @property
  def num_q_blocks(self) -> int:
    return -(-self.band.seq_q // self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return -(-self.band.seq_k // self.block_kv)

  @property
  def seq_q_padded(self) -> int:
    return self.num_q_blocks * self.block_q

  @property
  def seq_k_padded(self) -> int:
    return self.num_kv_blocks * self.block_kv

  def kv_block_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    """Per q block, the half-open kv block range ``[lo, hi)`` the band reaches
    (``lo = hi = 0`` when it reaches none)."""
    t = kv_block_table(self.band, self.block_q, self.block_kv)
    return t[:, 0], t[:, 3]

  def q_block_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    """Per kv block, the q blocks ``[lo, hi)`` that reach it."""
    t = q_block_table(self.band, self.block_kv, self.block_q)
    return t[:, 0], t[:, 3]
