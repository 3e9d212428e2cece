"""Forward: FlashAttention-2 loop order (q blocks outside, kv blocks inside) with
online softmax, skipping kv blocks outside the band and blocks whose segment ids
cannot match."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import dropout, epilogue
from ..common.compat import vary_like
from ..common.spec import AttentionSpec, Operands
from . import blocks
from .config import XlaConfig


def forward(ops: Operands, spec: AttentionSpec, config: XlaConfig):
  """Returns ``out [B, Sq, Hq, Dv]`` (q's dtype) and ``lse [B, Hq, Sq]`` (fp32)."""
  lay = blocks.make_layout(spec, config, config.fwd)
  prep = blocks.prepare(ops, lay)
  seg = blocks.segment_ranges(prep, lay)
  b, hkv, g = spec.batch, spec.heads_kv, spec.group_size
  acc_dt = lay.acc_dtype

  kt = blocks.keys_transposed(prep)
  # Raw products: m is kept unscaled and the scale applied inside exp.
  raw = blocks.raw_logits(prep, lay)
  mult = spec.softmax_scale if raw else 1.0

  def step(lay_q, i, j, carry, positional):
    m, l, acc = carry
    q_blk = blocks.slice_q(prep.q, lay_q, i)
    kt_blk = blocks.slice_kv(kt, lay, j, axis=3)
    s = jnp.einsum("bhgqd,bhdk->bhgqk", q_blk, kt_blk, precision=lay.precision,
                   preferred_element_type=acc_dt)
    if not raw:
      s, _ = blocks.finish_logits(s, prep, lay_q, i, j)
    ok = blocks.allowed(prep, lay_q, i, j, positional)
    if ok is not None:
      s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    # A row with nothing allowed so far keeps m = -inf; shift by 0 instead.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s * mult - (m_safe * mult)[..., None])
    alpha = jnp.exp((m - m_safe) * mult)
    l = l * alpha + p.sum(-1)
    if spec.dropout_rate > 0:
      p = jnp.where(blocks.dropout_keep(prep, lay_q, i, j), p, 0.0)
    pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(lay.compute_dtype),
                    blocks.slice_kv(prep.v, lay, j), precision=lay.precision,
                    preferred_element_type=acc_dt)
    return m_new, l, acc * alpha[..., None] + pv

  # Inside shard_map, loop carries vary along the mesh axes the operands do.
  vary = lambda x: vary_like(x, *jax.tree.leaves(prep))

  # Half-height edge steps update the top or bottom half of the row state.
  half = lay.block_q // 2
  take = lambda c, h: tuple(x[:, :, :, h * half:(h + 1) * half] for x in c)
  put = lambda c, sub, h: tuple(
      jax.lax.dynamic_update_slice_in_dim(x, y, h * half, 3) for x, y in zip(c, sub))

  def q_block(i):
    init = tuple(vary(x) for x in (
        jnp.full((b, hkv, g, lay.block_q), -jnp.inf, acc_dt),
        jnp.zeros((b, hkv, g, lay.block_q), acc_dt),
        jnp.zeros((b, hkv, g, lay.block_q, spec.head_dim_v), acc_dt)))
    m, l, acc = blocks.loop_blocks(step, prep, lay, seg, i, init, over_kv=True,
                                   halves=(take, put))
    lse = jnp.where(l > 0, m * mult + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    if spec.dropout_rate > 0:
      out = out * dropout.keep_scale(spec.dropout_rate)
    return out, lse

  out, lse = jax.lax.map(q_block, jnp.arange(lay.num_q_blocks))
  # [nq, B, Hkv, G, bq, X] -> [B, Hkv, G, Sqp, X]
  out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, lay.seq_q_padded, -1)
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, lay.seq_q_padded)
  out = blocks.from_q_layout(out, lay)
  lse = lse[..., :spec.seq_q].reshape(b, spec.heads_q, spec.seq_q)
  if spec.num_sinks:
    out, lse = epilogue.add_sinks(out, lse, ops.sinks)
  return out.astype(ops.q.dtype), lse  # lse fp32 (fp64 for fp64 inputs)
