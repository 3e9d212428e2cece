"""FLOP counting, aware of causal masks and sliding windows.

A forward pass does two matmuls per attended (query, key) pair: ``2*D`` FLOPs for
``q.k`` and ``2*Dv`` for ``p.v``. The backward does five (recompute ``q.k``, then
``dv``, ``dp``, ``dq``, ``dk``): 2.5x the forward, the FlashAttention papers'
convention. Only the band (causal / window) is counted; segment ids and dense masks
are data, and a kernel may or may not skip their empty blocks.
"""

from __future__ import annotations

import numpy as np

from .mask import Band


def attended_pairs(band: Band) -> int:
  """Exact number of (i, j) pairs the band allows."""
  if band.is_full:
    return band.seq_q * band.seq_k
  i = np.arange(band.seq_q, dtype=np.int64)
  lo = np.zeros_like(i) if band.left is None else np.maximum(
      0, i + band.offset - band.left)
  hi = np.full_like(i, band.seq_k) if band.right is None else np.minimum(
      band.seq_k, i + band.offset + band.right + 1)
  return int(np.maximum(hi - lo, 0).sum())


def forward_flops(*, batch: int, heads_q: int, head_dim: int, band: Band,
                  head_dim_v: int | None = None) -> int:
  dv = head_dim if head_dim_v is None else head_dim_v
  return 2 * batch * heads_q * (head_dim + dv) * attended_pairs(band)


def backward_flops(**kwargs) -> int:
  return int(2.5 * forward_flops(**kwargs))


def spec_flops(spec, direction: str = "fwd") -> int:
  """FLOPs of an :class:`AttentionSpec` for "fwd", "bwd" or "fwd_bwd"."""
  fwd = forward_flops(batch=spec.batch, heads_q=spec.heads_q,
                      head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
                      band=spec.band)
  factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[direction]
  return int(factor * fwd)
