"""Backward: kv blocks outside, q blocks inside (FlashAttention-2, Alg. 2).

Probabilities are recomputed block by block from the saved lse, so memory stays
O(S). dk/dv of one kv block accumulate in the inner loop's carry; dq (and dbias)
accumulate into full-size buffers carried by the outer loop, updated in place.
With ``dlse`` the softmax Jacobian gains one term:
``ds = p * (dp - delta)`` with ``delta = rowsum(do * o) - dlse``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import dropout, epilogue
from ..common.compat import vary_like
from ..common.blocking import pad_axis
from ..common.spec import AttentionSpec, Operands
from . import blocks
from .config import XlaConfig


def to_transposed(x):
  """``[B, Hkv, G, S, X]`` -> ``[B, Hkv, X, G, S]``."""
  return jnp.transpose(x, (0, 1, 4, 2, 3))


def transpose(x, back: bool = False):
  """A ``[.., G, q, kv]`` tile (or mask, size-1 dims allowed) as ``[.., kv, G, q]``,
  or back."""
  return jnp.moveaxis(x, 2, 4) if back else jnp.moveaxis(x, 4, 2)


def transpose_shape(shape):
  return tuple(shape[a] for a in (0, 1, 4, 2, 3))


def backward(ops: Operands, spec: AttentionSpec, config: XlaConfig, out, lse, do,
             dlse) -> Operands:
  lay = blocks.make_layout(spec, config, config.bwd)
  prep = blocks.prepare(ops, lay)
  acc_dt = lay.acc_dtype
  b, hkv, g = spec.batch, spec.heads_kv, spec.group_size
  seg = blocks.segment_ranges(prep, lay)

  row_delta = epilogue.delta(out, do, dlse)
  do = blocks.to_q_layout(do.astype(acc_dt), lay)
  # The step works on transposed tiles ([.., kv, G, q]): then p^T.dO and dS^T.Q,
  # the dV and dK products, read both operands in the layout XLA CPU's dot wants.
  # In [.., q, kv] order XLA transposed p and dS every step (~17% of a 512 x 256
  # step, 2026-11-22); dQ is accumulated transposed instead, from K^T.dS^T.
  q_t = to_transposed(prep.q)
  do_t = to_transposed(do)
  to_rows = lambda x, fill: pad_axis(
      x.astype(acc_dt).reshape(b, hkv, g, spec.seq_q), 3, lay.seq_q_padded, fill)
  delta = to_rows(row_delta, 0.0)
  # Empty and padded rows: lse = +inf makes every p there exactly 0.
  lse_safe = to_rows(epilogue.safe_lse(lse), jnp.inf)
  keep_scale = dropout.keep_scale(spec.dropout_rate)
  scale = spec.softmax_scale
  kt = blocks.keys_transposed(prep)

  def kv_block(j, carry):
    dq_t, dbias = carry
    k_blk = blocks.slice_kv(prep.k, lay, j)
    kt_blk = blocks.slice_kv(kt, lay, j, axis=3)
    v_blk = blocks.slice_kv(prep.v, lay, j)

    def step(lay_q, i, j, inner, positional):
      dk, dv, dq_t, dbias = inner
      rows = lambda x: blocks.slice_q(x, lay_q, i, axis=x.ndim - 1)[:, :, None]
      s, t = blocks.finish_logits(
          jnp.einsum("bhkd,bhdgq->bhkgq", k_blk, blocks.slice_q(q_t, lay_q, i, axis=4),
                     precision=lay.precision, preferred_element_type=acc_dt),
          prep, lay_q, i, j, transposed=True)
      p = jnp.exp(s - rows(lse_safe))
      ok = blocks.allowed(prep, lay_q, i, j, positional)
      if ok is not None:
        p = jnp.where(transpose(ok), p, 0.0)
      dp = jnp.einsum("bhkd,bhdgq->bhkgq", v_blk.astype(acc_dt),
                      blocks.slice_q(do_t, lay_q, i, axis=4), precision=lay.precision)
      pd = p
      if spec.dropout_rate > 0:
        keep = transpose(blocks.dropout_keep(prep, lay_q, i, j))
        pd = jnp.where(keep, p * keep_scale, 0.0)
        dp = jnp.where(keep, dp * keep_scale, 0.0)
      do_blk = blocks.slice_q(do, lay_q, i)
      dv = dv + jnp.einsum("bhkgq,bhgqd->bhkd", pd, do_blk, precision=lay.precision)
      ds = p * (dp - rows(delta))
      if t is not None:
        ds = ds * (1.0 - t * t)  # d(cap * tanh(x / cap)) / dx
      if dbias is not None:
        db = transpose(epilogue.reduce_to_shape(ds, transpose_shape(dbias.shape)),
                       back=True)
        # One index dtype: under jax_enable_x64 the scan index j is int64 while
        # the loop index i is int32, and dynamic_slice rejects a mix.
        starts = [jnp.asarray(s, jnp.int32) for s in (
            0, 0, 0, i * lay_q.block_q if dbias.shape[3] > 1 else 0,
            j * lay.block_kv if dbias.shape[4] > 1 else 0)]
        old = jax.lax.dynamic_slice(dbias, starts, db.shape)
        dbias = jax.lax.dynamic_update_slice(dbias, old + db, starts)
      ds_c = ds.astype(lay.compute_dtype)
      dq_blk = jnp.einsum("bhdk,bhkgq->bhdgq", kt_blk, ds_c, precision=lay.precision,
                          preferred_element_type=acc_dt) * scale
      start = i * lay_q.block_q
      old = jax.lax.dynamic_slice_in_dim(dq_t, start, lay_q.block_q, 4)
      dq_t = jax.lax.dynamic_update_slice_in_dim(dq_t, old + dq_blk, start, 4)
      q_blk = blocks.slice_q(prep.q, lay_q, i)
      dk = dk + jnp.einsum("bhkgq,bhgqd->bhkd", ds_c, q_blk, precision=lay.precision,
                           preferred_element_type=acc_dt) * scale
      return dk, dv, dq_t, dbias

    init = (vary(jnp.zeros((b, hkv, lay.block_kv, spec.head_dim), acc_dt)),
            vary(jnp.zeros((b, hkv, lay.block_kv, spec.head_dim_v), acc_dt)), dq_t,
            dbias)
    dk, dv, dq_t, dbias = blocks.loop_blocks(step, prep, lay, seg, j, init,
                                             over_kv=False)
    return (dq_t, dbias), (dk, dv)

  # Inside shard_map, loop carries vary along the mesh axes the operands do.
  vary = lambda x: vary_like(x, *jax.tree.leaves(prep), do_t, lse_safe, delta)
  dq0 = vary(jnp.zeros((b, hkv, spec.head_dim, g, lay.seq_q_padded), acc_dt))
  db0 = None if prep.bias is None else vary(jnp.zeros(prep.bias.shape, acc_dt))
  (dq_t, dbias), (dk, dv) = jax.lax.scan(
      lambda c, j: kv_block(j, c), (dq0, db0), jnp.arange(lay.num_kv_blocks))
  dq = jnp.moveaxis(dq_t, 2, 4)  # [B, Hkv, G, Sqp, D]
  # [nk, B, Hkv, bk, X] -> [B, Hkv, Skp, X]
  dk = jnp.moveaxis(dk, 0, 2).reshape(b, hkv, lay.seq_k_padded, -1)
  dv = jnp.moveaxis(dv, 0, 2).reshape(b, hkv, lay.seq_k_padded, -1)

  dsinks = None
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, row_delta)
  return Operands(
      q=blocks.from_q_layout(dq, lay).astype(ops.q.dtype),
      k=blocks.from_kv_layout(dk, lay).astype(ops.k.dtype),
      v=blocks.from_kv_layout(dv, lay).astype(ops.v.dtype),
      bias=None if dbias is None else blocks.from_grouped(
          dbias, lay, ops.bias.shape).astype(ops.bias.dtype),
      sinks=dsinks)
