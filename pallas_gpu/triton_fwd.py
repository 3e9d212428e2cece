"""Pallas-Triton forward kernel: grid (q blocks, B, Hq), one program per q tile,
online softmax in base 2 over the kv tiles the band reaches.

The kv loop runs in three stages: edge tiles that the band (or the padded key
tail) cuts need the positional mask, interior tiles do not, so most of a causal or
windowed problem runs the unmasked loop (FlashAttention-2's split of the causal
loop). Tiles are read straight from the [B, S, H, D] inputs (the head axis is a
squeezed block dim), so no transpose is materialised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import triton_plan as tp


def tiles(r: dict, plan: tp.Plan, i, j, bq: int, bk: int):
  """Bias, mask and kv segment-id tiles of block (i, j) (None when absent)."""
  out = {}
  for name in ("bias", "mask"):
    if name in r:
      ref = r[name]
      rows = pl.ds(i * bq, bq) if ref.shape[0] > 1 else pl.ds(0, 1)
      cols = pl.ds(j * bk, bk) if ref.shape[1] > 1 else pl.ds(0, 1)
      out[name] = ref[rows, cols]
  out["kv_ids"] = r["kv_ids"][pl.ds(j * bk, bk)] if "kv_ids" in r else None
  return out


def stages(plan: tp.Plan, lo, lo_full, hi_full, hi, body, carry):
  """Runs ``body(j, carry, positional)`` over [lo, hi), masking only edge tiles."""
  if plan.spec.band.is_full and plan.seq_k_padded == plan.spec.seq_k:
    return jax.lax.fori_loop(lo, hi, functools.partial(body, positional=False), carry)
  carry = jax.lax.fori_loop(lo, lo_full, functools.partial(body, positional=True),
                            carry)
  carry = jax.lax.fori_loop(lo_full, hi_full,
                            functools.partial(body, positional=False), carry)
  return jax.lax.fori_loop(hi_full, hi, functools.partial(body, positional=True),
                           carry)


def _kernel(*refs, plan: tp.Plan, names):
  r = dict(zip(names, refs))
  spec = plan.spec
  bq, bk = plan.block_q, plan.block_kv
  i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q = r["q"][...]
  q_ids = r["q_ids"][...] if "q_ids" in r else None
  seed = r.get("seed")

  # Without bias or cap the row max is taken on the raw products and the scale
  # rides in the exp2 argument (one FMA per element instead of a multiply and a
  # subtract).
  raw = "bias" not in r and spec.logits_soft_cap is None
  mult = spec.softmax_scale * tp.LOG2E if raw else 1.0

  def body(j, carry, positional):
    acc, m, l = carry
    t = tiles(r, plan, i, j, bq, bk)
    k = r["k"][pl.ds(j * bk, bk), :]
    v = r["v"][pl.ds(j * bk, bk), :]
    if raw:
      s = tp.dot(q, k, plan, trans_b=True)
    else:
      s, _ = tp.logits2(plan, q, k, t.get("bias"))
    ok = tp.allowed(plan, i, j, positional, q_ids, t["kv_ids"], t.get("mask"))
    if ok is not None:
      s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    # A row with nothing allowed yet keeps m = -inf; shift by 0 so exp2 gives 0.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = tp.exp2(s * mult - (m_safe * mult)[:, None], plan)
    alpha = tp.exp2((m - m_safe) * mult, plan)
    l = l * alpha + p.sum(axis=1)
    if seed is not None:
      p = jnp.where(tp.dropout_keep(plan, seed, b, h, i, j), p, 0.0)
    acc = acc * alpha[:, None] + tp.dot(p.astype(v.dtype), v, plan)
    return acc, m_new, l

  init = (jnp.zeros((bq, plan.head_dim_v_padded), jnp.float32),
          jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
  acc, m, l = stages(plan, *plan.kv_ranges(i), body, init)
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  out = acc / safe_l[:, None]
  if spec.dropout_rate > 0:
    out = out * (1.0 / (1.0 - spec.dropout_rate))
  r["o"][...] = out.astype(r["o"].dtype)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  r["lse"][...] = jnp.where(nonempty, (m_safe * mult + jnp.log2(safe_l)) * tp.LN2,
                            -jnp.inf)


def in_specs(x: tp.KernelOperands, plan: tp.Plan, q_map, kv_map, bh_map):
  """Block specs of the operands every kernel reads whole-sequence: (name, spec,
  array) for bias, mask, ids and seed; q/k/v are the caller's."""
  out = []
  for name in ("bias", "mask"):
    arr = getattr(x, name)
    if arr is not None:
      shape = arr.shape
      out.append((name, pl.BlockSpec(
          (None, None, shape[2], shape[3]),
          lambda *g, shape=shape: tuple(
              idx if n > 1 else 0 for idx, n in zip(bh_map(*g), shape[:2])) + (0, 0)),
          arr))
  if x.q_ids is not None:
    out.append(("q_ids", q_map, x.q_ids))
    out.append(("kv_ids", kv_map, x.kv_ids))
  if x.seed is not None:
    out.append(("seed", pl.BlockSpec((4,), lambda *g: (0,)), x.seed))
  return out


def forward(x: tp.KernelOperands, plan: tp.Plan, cfg: tp.KernelConfig, interpret):
  """``out [B, Sqp, Hq, Dvp]`` (input dtype), ``lse [B, Hq, Sqp]`` (fp32, rows
  only, no sinks)."""
  spec = plan.spec
  bq, g = plan.block_q, spec.group_size
  dp, dvp = plan.head_dim_padded, plan.head_dim_v_padded
  skp = plan.seq_k_padded
  specs = [
      ("q", pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)), x.q),
      ("k", pl.BlockSpec((None, skp, None, dp), lambda i, b, h: (b, 0, h // g, 0)), x.k),
      ("v", pl.BlockSpec((None, skp, None, dvp), lambda i, b, h: (b, 0, h // g, 0)),
       x.v),
  ] + in_specs(x, plan,
               pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
               pl.BlockSpec((None, skp), lambda i, b, h: (b, 0)),
               lambda i, b, h: (b, h))
  names = [n for n, _, _ in specs] + ["o", "lse"]
  out_shape = [jax.ShapeDtypeStruct((spec.batch, plan.seq_q_padded, spec.heads_q, dvp),
                                    x.q.dtype),
               jax.ShapeDtypeStruct((spec.batch, spec.heads_q, plan.seq_q_padded),
                                    jnp.float32)]
  out_specs = [pl.BlockSpec((None, bq, None, dvp), lambda i, b, h: (b, i, h, 0)),
               pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))]
  return pl.pallas_call(
      functools.partial(_kernel, plan=plan, names=names),
      grid=(plan.num_q_blocks, spec.batch, spec.heads_q),
      in_specs=[s for _, s, _ in specs], out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret, name="flashjax_pallas_triton_fwd",
  )(*(a for _, _, a in specs))
