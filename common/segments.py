"""Block ranges of segment ids: which blocks of a packed call can meet.

Packed rows hold several documents told apart by segment ids (``mask.py``: a
query sees a key only where their ids are equal). Two blocks whose id ranges
``[min, max]`` are disjoint share no id, for sorted or unsorted ids, so a kernel
can skip them. For the usual layout (sorted ids, documents one after another)
the blocks a q block meets form one run, and narrowing each q block's kv loop
(each kv block's q loop for dK/dV) to that run skips every block between
documents: the per-program work follows the documents' own blocks.

All functions take traced ids (the ranges are data, computed once per call):

* :func:`block_id_ranges`: per-block ``(min, max)`` of the ids, O(S);
  :func:`id_ranges` of both sides at once;
* :func:`blocks_meet`: the per-block predicate on those ranges;
* :func:`visible_kv_blocks` / :func:`visible_q_blocks`: per q block (kv block),
  the first and one-past-last block of the band's range whose ids can meet it
  (:func:`visible_blocks` picks one by direction);
* :func:`single_id_blocks`: the run of blocks where the ids mask nothing;
* :func:`narrow`: a platform's own nondecreasing loop boundaries (masked edge,
  interior, masked edge runs) clipped to such a range;
* :func:`spans`: per query (per key), the one run of keys (queries) it may see,
  with the band and the real length folded in, for contiguous segments (each
  id's positions on the other side one run); a kernel then masks with two
  compares of positions and streams no ids of the other side;
  :func:`span_blocks`: the visible-block table from those spans.
"""

from __future__ import annotations

import jax.numpy as jnp

from .blocking import kv_block_table, q_block_table
from .mask import Band


def block_id_ranges(ids, block: int, num_blocks: int | None = None):
  """``ids [B, S]`` -> per-block ``(min, max)``, each ``[B, num_blocks]`` int32.

  Blocks are ``block`` positions wide; ``num_blocks`` (default ``ceil(S /
  block)``) may cover padding past ``S``, which repeats the last id so that it
  does not widen a block's range (padded positions are masked by the kernels).
  """
  b, s = ids.shape
  n = -(-s // block) if num_blocks is None else num_blocks
  if n * block < s:
    raise ValueError(f"num_blocks * block must cover the ids' length {s}, got "
                     f"num_blocks={n}, block={block}")
  x = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, n * block - s)), mode="edge")
  x = x.reshape(b, n, block)
  return x.min(-1), x.max(-1)


def id_ranges(q_ids, kv_ids, block_q: int, block_kv: int,
              num_q_blocks: int | None = None, num_kv_blocks: int | None = None):
  """:func:`block_id_ranges` of ``q_ids [B, Sq]`` and ``kv_ids [B, Sk]`` (the real
  lengths): ``((qmin, qmax), (kmin, kmax))``, the ranges the other functions take."""
  return (block_id_ranges(q_ids, block_q, num_q_blocks),
          block_id_ranges(kv_ids, block_kv, num_kv_blocks))


def blocks_meet(q_ranges, kv_ranges, i, j):
  """Whether q block(s) ``i`` and kv block(s) ``j`` may share an id: ``[B]`` bool
  for scalar indices (or broadcast over index arrays)."""
  (qmin, qmax), (kmin, kmax) = q_ranges, kv_ranges
  return (qmin[:, i] <= kmax[:, j]) & (kmin[:, j] <= qmax[:, i])


def _meet(outer, inner):
  """``[B, n_outer, n_inner]`` bool: whether each outer block's id range meets
  each inner block's. Built in the orientation the reductions need (the inner
  blocks minor), so no transpose is materialised. Block-level, so small next to
  the attention itself: 65,536 entries per row for 16k tokens in 64 x 64 blocks."""
  (omin, omax), (imin, imax) = outer, inner
  return ((omin[:, :, None] <= imax[:, None, :]) &
          (imin[:, None, :] <= omax[:, :, None]))


def _first_last(cond):
  """``cond [B, no, ni]`` -> ``(first, last + 1)`` along the minor axis per outer
  block, ``(0, 0)`` where none holds: min / max reductions of the minor axis,
  which XLA fuses with the predicate's computation."""
  j = jnp.arange(cond.shape[-1], dtype=jnp.int32)
  first = jnp.where(cond, j, cond.shape[-1]).min(-1)
  stop = jnp.where(cond, j + 1, 0).max(-1)
  return jnp.where(stop > 0, first, 0), stop


def _reach(band: Band | None, block_q: int, block_kv: int, nq: int, nk: int,
           over_kv: bool):
  """``[1, n_outer, n_inner]`` bool: the inner blocks (kv blocks ``over_kv``, else
  q blocks) each outer block reaches through the band; ``True`` (all of them)
  without one. Outer blocks past the real length (padding) reach nothing. Built
  from the band's per-block bounds, not a dense ``[n_outer, n_inner]`` constant:
  at 128k tokens in 64 x 128 blocks that constant made the lowered tables 8.4 MB
  of StableHLO text, against 45 KB from the bounds, and they compiled in 0.77
  against 0.38 s (the 2-core CI VM, 2026-11-24).
  """
  if band is None:
    return True
  table = (kv_block_table(band, block_q, block_kv, nq) if over_kv
           else q_block_table(band, block_kv, block_q, nk))
  inner = jnp.arange(nk if over_kv else nq, dtype=jnp.int32)[None, None, :]
  lo, hi = (jnp.asarray(table[None, :, c:c + 1]) for c in (0, 3))
  return (inner >= lo) & (inner < hi)


def visible_kv_blocks(q_ranges, kv_ranges, band: Band | None = None,
                      block_q: int | None = None, block_kv: int | None = None):
  """Per q block, the kv blocks ``[lo, hi)`` from the first to the last one that
  both the band reaches and whose ids can meet the q block's; ``[B, nq]`` int32
  each, ``lo = hi = 0`` where none. Without ``band``, every kv block is in reach.

  Every block holding an allowed (query, key) pair lies in the range; blocks
  inside it whose ids cannot meet are left to :func:`blocks_meet` (with sorted
  ids there are none)."""
  nq, nk = q_ranges[0].shape[1], kv_ranges[0].shape[1]
  reach = _reach(band, block_q, block_kv, nq, nk, over_kv=True)
  return _first_last(_meet(q_ranges, kv_ranges) & reach)


def visible_q_blocks(q_ranges, kv_ranges, band: Band | None = None,
                     block_q: int | None = None, block_kv: int | None = None):
  """The transpose, for the dK/dV pass: per kv block, the q blocks ``[lo, hi)``
  that reach it and whose ids can meet its own; ``[B, nk]`` int32 each."""
  nq, nk = q_ranges[0].shape[1], kv_ranges[0].shape[1]
  reach = _reach(band, block_q, block_kv, nq, nk, over_kv=False)
  return _first_last(_meet(kv_ranges, q_ranges) & reach)


def single_id_blocks(q_ranges, kv_ranges, over_kv: bool = True):
  """Per q block (``over_kv=False``: per kv block), the run ``[lo, hi)`` of blocks
  of the other side that hold one id, the same one as the block's own, so that
  segment ids mask nothing between them (a kernel may drop the ids' mask there);
  ``[B, n]`` int32 each, ``lo = hi = 0`` where no such run exists or where such
  blocks are not one unbroken run (unsorted ids)."""
  (omin, omax), (imin, imax) = ((q_ranges, kv_ranges) if over_kv
                                else (kv_ranges, q_ranges))
  same = ((omin == omax)[:, :, None] & (imin == imax)[:, None, :] &
          (omin[:, :, None] == imin[:, None, :]))
  lo, hi = _first_last(same)
  count = same.sum(-1, dtype=jnp.int32)
  unbroken = count == hi - lo
  return jnp.where(unbroken, lo, 0), jnp.where(unbroken, hi, 0)


def visible_blocks(q_ranges, kv_ranges, band: Band | None, block_q: int,
                   block_kv: int, *, over_kv: bool):
  """:func:`visible_kv_blocks` (``over_kv``: per q block) or
  :func:`visible_q_blocks` (per kv block)."""
  visible = visible_kv_blocks if over_kv else visible_q_blocks
  return visible(q_ranges, kv_ranges, band, block_q, block_kv)


def narrow(bounds, lo, hi):
  """Nondecreasing loop boundaries ``b0 <= b1 <= ... <= bn`` (consecutive runs
  ``[b_k, b_k+1)``) clipped to ``[lo, hi)``: each run becomes its intersection
  with the range, and the boundaries stay nondecreasing."""
  return tuple(jnp.clip(b, lo, jnp.maximum(lo, hi)) for b in bounds)


def id_runs(ids, other):
  """Per position of ``ids [B, S]``, the run ``[lo, hi)`` of ``other [B, So]``'s
  positions holding its id (``lo = hi = 0`` where none does), for contiguous
  segments: each id's positions in ``other`` one run, and ``other``'s ids in
  ``[-So, So)`` (else the result is undefined).

  O(S + So), no sort and no scan: each run of ``other`` records its first and
  last position in a slot ``id mod 2 So`` (ids in ``[-So, So)`` never share
  one). Only run ends are scattered, so a slot takes at most two writes per
  run: scattering every position made a long run's atomic updates queue on one
  address. (Finding the runs by a sort or by cumulative scans made packed
  forwards at 16k tokens 0.68-0.96x of the ids' compare on an H200,
  2026-11-27; with scatters 1.04-1.08x.)"""
  ids, other = ids.astype(jnp.int32), other.astype(jnp.int32)
  b, so = other.shape
  slots = 2 * so
  pos = jnp.broadcast_to(jnp.arange(so, dtype=jnp.int32), (b, so))
  row = jnp.arange(b, dtype=jnp.int32)[:, None]
  change = other[:, 1:] != other[:, :-1]
  edge = jnp.ones((b, 1), jnp.bool_)
  starts = jnp.concatenate([edge, change], axis=1)
  ends = jnp.concatenate([change, edge], axis=1)
  # A run's start and end share their id's slot: one max-scatter of the pair
  # (So - first, last) writes both (-1 where a position is not that end).
  pair = jnp.stack([jnp.where(starts, so - pos, -1), jnp.where(ends, pos, -1)], -1)
  slot = jnp.where(starts | ends, jnp.remainder(other, slots), slots)
  table = jnp.full((b, slots, 2), -1, jnp.int32).at[row, slot].max(pair, mode="drop")
  found = jnp.take_along_axis(table, jnp.remainder(ids, slots)[:, :, None], axis=1)
  # An empty slot holds (-1, -1): first = So + 1 and last = -1, an empty span.
  lo, hi = so - found[..., 0], found[..., 1] + 1
  hit = jnp.take_along_axis(other, jnp.minimum(lo, so - 1), axis=1) == ids
  return jnp.where(hit, lo, 0), jnp.where(hit, hi, 0)


def spans(q_ids, kv_ids, band: Band | None, seq_q: int, seq_k: int, *,
          over_kv: bool = True):
  """Per query (``over_kv=False``: per key), the positions of the other side it
  may attend to as one run ``[lo, hi)``: the keys (queries) holding its id,
  within the band, below the real length ``seq_k`` (``seq_q``), ``[B, 2, n]``
  int32. ``q_ids [B, Sq']`` and ``kv_ids [B, Sk']`` may be padded past the real
  lengths (positions are those of the arrays, which the band's diagonal also
  uses).

  Exact for contiguous segments (:func:`id_runs`' promise). Computed from the
  ids in O(S), for kernels whose masked steps then compare each position with
  its row's two bounds."""
  own, other = (q_ids, kv_ids) if over_kv else (kv_ids, q_ids)
  lo, hi = id_runs(own, other)
  i = jnp.arange(own.shape[1], dtype=jnp.int32)[None, :]
  hi = jnp.minimum(hi, seq_k if over_kv else seq_q)
  if band is not None:
    # Query i sees key j where -left <= j - i - offset <= right.
    lower, upper = (band.left, band.right) if over_kv else (band.right, band.left)
    sign = 1 if over_kv else -1
    if lower is not None:
      lo = jnp.maximum(lo, i + sign * band.offset - lower)
    if upper is not None:
      hi = jnp.minimum(hi, i + sign * band.offset + upper + 1)
  return jnp.stack([lo, hi], axis=1)


def span_blocks(spans, block: int, other_block: int):
  """The visible-block table of :func:`spans`: per block of ``block`` own
  positions (``spans [B, 2, n]``, ``n`` a multiple of ``block``), the other
  side's blocks of ``other_block`` positions ``[lo, hi)`` that a nonempty span
  reaches and the run ``[one_lo, one_hi)`` that every span of the block covers
  whole; ``[B, 4, n / block]`` int32, ``(0, 0)`` where none. A kernel may skip
  every mask in that run: the other side's band and real length are in the
  spans. Own positions past their real length (padding, with the last id's
  span) count like the others, so they may narrow the run and widen
  ``[lo, hi)``.

  The layout of :func:`visible_blocks` with :func:`single_id_blocks`, whose run
  leaves the band's mask to the kernel; this run needs none. One reduction over
  the spans instead of the ids' block ranges and their ``[B, n_own, n_other]``
  comparisons."""
  b, _, n = spans.shape
  lo, hi = (spans[:, i].reshape(b, n // block, block) for i in (0, 1))
  some = lo < hi
  reached = some.any(-1)
  first = jnp.where(some, lo, jnp.iinfo(jnp.int32).max).min(-1)
  stop = jnp.where(some, hi, 0).max(-1)
  # Spans start at 0 or later: ceil by negated floor division.
  one_lo, one_hi = -(-lo.max(-1) // other_block), hi.min(-1) // other_block
  whole = one_lo < one_hi  # every span nonempty and covering a block
  return jnp.stack([jnp.where(reached, first // other_block, 0),
                    jnp.where(reached, -(-stop // other_block), 0),
                    jnp.where(whole, one_lo, 0), jnp.where(whole, one_hi, 0)], axis=1)
