"""What attends to what: the single definition every platform lowers.

A query at row ``i`` may attend to key ``j`` iff *all* parts of the mask allow it:

* the band: ``d = j - (i + Sk - Sq)`` is the offset from the bottom-right aligned
  diagonal (FlashAttention-2 convention); ``left`` bounds it below (``d >= -left``),
  ``right`` above (``d <= right``); ``None`` is unbounded. Causal is ``right = 0``.
* segment ids: ``q_ids[b, i] == kv_ids[b, j]``;
* a dense bool mask broadcastable to ``[B, Hq, Sq, Sk]`` (True = attend).

Kernels evaluate :func:`tile_allowed` on their block's positions
(``blocking.positions``) and skip whole blocks by the ranges of
``blocking.kv_block_range``, so the reference and every kernel share one
predicate.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class Band:
  """The static (shape-only) part of the mask: causal / sliding window.

  Attributes:
    seq_q, seq_k: sequence lengths; their difference aligns the diagonal.
    left: how far left of the aligned diagonal a query sees (None = unbounded).
    right: how far right of it (None = unbounded; 0 = causal).
  """

  seq_q: int
  seq_k: int
  left: int | None = None
  right: int | None = None

  @property
  def offset(self) -> int:
    return self.seq_k - self.seq_q

  @property
  def is_full(self) -> bool:
    return self.left is None and self.right is None

  @property
  def causal(self) -> bool:
    return self.right is not None and self.right <= 0

  def kv_bounds(self, q_lo: int, q_hi: int) -> tuple[int, int]:
    """Half-open key range ``[lo, hi)`` that rows ``[q_lo, q_hi)`` can reach.

    Clipped to ``[0, seq_k]``; ``lo >= hi`` means the rows attend to nothing.
    """
    lo, hi = 0, self.seq_k
    if self.left is not None:
      lo = max(lo, q_lo + self.offset - self.left)
    if self.right is not None:
      hi = min(hi, q_hi + self.offset + self.right)
    return lo, max(lo, hi)

  def q_bounds(self, k_lo: int, k_hi: int) -> tuple[int, int]:
    """Half-open query range ``[lo, hi)`` that can reach keys ``[k_lo, k_hi)``
    (the transpose of :meth:`kv_bounds`, for backward passes over key blocks)."""
    lo, hi = 0, self.seq_q
    if self.right is not None:
      lo = max(lo, k_lo - self.offset - self.right)
    if self.left is not None:
      hi = min(hi, k_hi - self.offset + self.left)
    return lo, max(lo, hi)

  def sub_block(self, q_start: int, seq_q: int, k_start: int,
                seq_k: int) -> "Band | None":
    """The band of the block of rows ``[q_start, q_start + seq_q)`` and keys
    ``[k_start, k_start + seq_k)``, in the block's own coordinates, or None when
    no row of the block reaches any of its keys.

    A global diagonal offset ``d`` is the block's ``d_local + shift`` with
    ``shift = (seq_k - seq_q) + k_start - q_start - self.offset``, so the bounds
    move by ``shift``; bounds the block cannot reach become None (a block the
    band covers whole is full).
    """
    shift = (seq_k - seq_q) + k_start - q_start - self.offset
    left = None if self.left is None else self.left + shift
    right = None if self.right is None else self.right - shift
    lo, hi = 1 - seq_k, seq_q - 1  # range of j - (i + seq_k - seq_q) in the block
    if max(lo, -left if left is not None else lo) > min(
        hi, right if right is not None else hi):
      return None
    return Band(seq_q=seq_q, seq_k=seq_k,
                left=None if left is None or left >= seq_k - 1 else left,
                right=None if right is None or right >= seq_q - 1 else right)

  def as_array(self):
    """Dense ``[Sq, Sk]`` bool form of the band."""
    i = jnp.arange(self.seq_q, dtype=jnp.int32)[:, None]
    j = jnp.arange(self.seq_k, dtype=jnp.int32)[None, :]
    return band_allowed(i, j, self)


def band_allowed(i, j, band: Band):
  """Elementwise band predicate on broadcastable row/column index arrays.

  Returns a bool array, or None when the band allows everything (so kernels
  can skip the work).
  """
  if band.is_full:
    return jnp.ones(jnp.broadcast_shapes(jnp.shape(i), jnp.shape(j)), jnp.bool_)
  d = j - (i + band.offset)
  ok = None
  if band.left is not None:
    ok = d >= -band.left
  if band.right is not None:
    r = d <= band.right
    ok = r if ok is None else ok & r
  return ok


def tile_allowed(band: Band, rows=None, cols=None, *, padded_keys: bool = False,
                 q_ids=None, kv_ids=None, mask=None):
  """What the (row, key) pairs of one tile may attend to: the band, the key
  tail, segment ids and a dense mask, each left out when not given.

  Args:
    band: the call's band.
    rows, cols: broadcastable global row and key indices of the tile
      (``blocking.positions``), or None to leave out the band and the key tail
      (a block that ``blocking.kv_block_range`` says is full).
    padded_keys: keys at or past ``band.seq_k`` are padding: mask them.
    q_ids, kv_ids: segment ids, broadcastable to the tile against each other.
    mask: bool, or ints with nonzero = attend, broadcastable to the tile.

  Returns:
    A bool array (NumPy for NumPy indices and no other operand), or None when
    everything is allowed.
  """
  ok = None
  both = lambda a, b: b if a is None else a & b
  if rows is not None:
    if not band.is_full:
      ok = band_allowed(rows, cols, band)
    if padded_keys:
      ok = both(ok, cols < band.seq_k)
  if q_ids is not None:
    ok = both(ok, q_ids == kv_ids)
  if mask is not None:
    ok = both(ok, mask if mask.dtype == jnp.bool_ else mask != 0)
  return ok


def segment_allowed(q_ids, kv_ids):
  """``[B, Sq]``, ``[B, Sk]`` int ids -> ``[B, Sq, Sk]`` bool."""
  return q_ids[:, :, None] == kv_ids[:, None, :]


@dataclasses.dataclass(frozen=True)
class Mask:
  """All parts of the mask together; ``as_array`` is the definition.

  ``segment_ids`` is ``(q_ids [B, Sq], kv_ids [B, Sk])`` or None; ``dense`` is a
  bool array of rank 4 broadcastable to ``[B, Hq, Sq, Sk]`` or None.
  """

  band: Band
  segment_ids: tuple | None = None
  dense: object | None = None

  def as_array(self):
    """Bool, broadcastable to ``[B, Hq, Sq, Sk]`` (rank 4)."""
    out = self.band.as_array()[None, None]
    if self.segment_ids is not None:
      out = out & segment_allowed(*self.segment_ids)[:, None]
    if self.dense is not None:
      out = out & self.dense
    return out
