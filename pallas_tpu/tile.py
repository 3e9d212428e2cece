"""In-kernel math on one (batch, head, q block, kv block) tile, shared by the
forward and both backward kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import blocking
from ..common import dropout as dropout_lib
from ..common.mask import tile_allowed
from .plan import Plan

_NT = (((1,), (1,)), ((), ()))  # a @ b.T without materialising the transpose


def precision(dtype):
  # fp32 inputs: full-precision MXU passes, so the platform stays exact.
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def matmul_nt(a, b):
  return jax.lax.dot_general(a, b, _NT, precision=precision(a.dtype),
                             preferred_element_type=jnp.float32)


def matmul(a, b, contract_lhs=1):
  """``a @ b`` (contract_lhs=1) or ``a.T @ b`` (contract_lhs=0), fp32 accumulate."""
  dims = (((contract_lhs,), (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision(b.dtype),
                             preferred_element_type=jnp.float32)


def init_rows(m_sc, l_sc, acc_sc, cnt_ref=None):
  """A q tile's first step: running max -inf, sum and accumulator 0 (and the
  executed-step counter of tests, if any)."""
  m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
  l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
  if cnt_ref is not None:
    cnt_ref[...] = jnp.zeros(cnt_ref.shape, jnp.int32)


def online_softmax(s, m_sc, l_sc):
  """One step of the online softmax over logits ``s`` (-inf where masked), with
  the running row max and sum in the VMEM scratch ``m_sc``, ``l_sc`` (rows
  broadcast along lanes): updates both and returns ``(p, alpha)``, the step's
  unnormalised probabilities and the rescale of what was accumulated before."""
  m_prev = m_sc[:, :1]
  m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
  # Rows with nothing allowed yet keep m = -inf; shift by 0 so exp gives 0.
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  p = jnp.exp(s - m_safe)
  alpha = jnp.exp(m_prev - m_safe)
  l_sc[...] = jnp.broadcast_to(alpha * l_sc[:, :1] + p.sum(axis=1, keepdims=True),
                               l_sc.shape)
  m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
  return p, alpha


def finish_rows(acc_sc, m_sc, l_sc, scale: float = 1.0):
  """``(out, lse)`` of the rows: the accumulator over the row sums (times
  ``scale``), and m + log(l); rows that saw no key give 0 and -inf."""
  l = l_sc[:, :1]
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  out = acc_sc[...] / safe_l
  if scale != 1.0:
    out = out * scale
  return out, jnp.where(nonempty, m_sc[:, :1] + jnp.log(safe_l), -jnp.inf)


def scores(plan: Plan, q, k, bias):
  """Scaled, biased, soft-capped fp32 logits ``[bq, bk]`` and the tanh of the
  soft cap (for the backward's chain rule) or None."""
  s = matmul_nt(q, k) * plan.spec.softmax_scale
  if bias is not None:
    s = s + bias
  cap = plan.spec.logits_soft_cap
  if cap is None:
    return s, None
  t = jnp.tanh(s / cap)
  return cap * t, t


def allowed(plan: Plan, i, j, q_ids=None, kv_ids=None, mask=None):
  """Bool ``[bq, bk]`` of what the tile may attend to (``mask.tile_allowed``),
  or None for everything; ids ``[bq, 1]`` and ``[1, bk]``."""
  spec = plan.spec
  rows, cols = blocking.positions(i, j, plan.block_q, plan.block_kv)
  return tile_allowed(spec.band, rows, cols,
                      padded_keys=plan.seq_k_padded != spec.seq_k,
                      q_ids=q_ids, kv_ids=kv_ids, mask=mask)


def dropout_keep(plan: Plan, seed_ref, b, h, i, j):
  """Keep-mask ``[bq, bk]`` of ``dropout.keep`` at global coordinates: ``b``/``h``
  and the tile's positions are local, ``seed_ref`` (SMEM,
  ``dropout_lib.kernel_seed``) adds the offsets of the shard (batch, head) and of
  the block of a larger call (row, key: a hop of ring attention); the row key is
  hashed once per row."""
  rows, cols = blocking.positions(i, j, plan.block_q, plan.block_kv)
  return dropout_lib.keep(seed_ref[0], b + seed_ref[1], h + seed_ref[2],
                          rows[:, :1] + seed_ref[3], cols + seed_ref[4],
                          plan.spec.dropout_rate)


def segments_meet(seg_refs, plan: Plan, b, i, j):
  """Scalar: can block (i, j) of batch b share a segment id (from SMEM ranges)?"""
  qmin, qmax, kmin, kmax = seg_refs
  # Steps past a row's range carry indices past the tables: clamp the reads
  # (those steps are skipped by the band check anyway).
  qi = b * plan.num_q_blocks + jnp.minimum(i, plan.num_q_blocks - 1)
  kj = b * plan.num_kv_blocks + jnp.minimum(j, plan.num_kv_blocks - 1)
  return (qmin[qi] <= kmax[kj]) & (kmin[kj] <= qmax[qi])
