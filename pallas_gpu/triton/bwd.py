"""Pallas-Triton backward: a dq kernel (grid over q tiles, loop over kv tiles) and a
dkv kernel (grid over kv tiles, loop over q tiles), FlashAttention-2 Alg. 2 split
in two so that no atomics are needed: results are deterministic.

Probabilities are recomputed from the saved lse (+inf on empty rows, so p = 0
there); ``delta = rowsum(do * o) - dlse`` comes from XLA. With a bias, the dq
kernel also writes ds into a zero-initialised [B, Hq, Sqp, Skp] buffer for dbias.
For GQA the dkv kernel runs per query head and XLA sums each group's partial
dk/dv in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...common import dropout
from ...common.blocking import LOG2E
from . import plan as tp
from .fwd import in_specs, segment_specs, stages, tiles


def _p_ds(plan: tp.Plan, r, t, q, k, v, do, lse2, delta, q_ids, b, h, i, j,
          positional):
  """Dropped-out p and ds of one tile (ds through the soft cap)."""
  spec = plan.spec
  s, tanh = tp.logits2(plan, q, k, t.get("bias"))
  p = tp.exp2(s - lse2[:, None], plan)
  ok = tp.allowed(plan, i, j, positional, q_ids, t["kv_ids"], t.get("mask"))
  if ok is not None:
    p = jnp.where(ok, p, 0.0)
  dp = tp.dot(do, v, plan, trans_b=True)
  pd = p
  if "seed" in r:
    keep = tp.dropout_keep(plan, r["seed"], b, h, i, j)
    scale = dropout.keep_scale(spec.dropout_rate)
    pd = jnp.where(keep, p * scale, 0.0)
    dp = jnp.where(keep, dp * scale, 0.0)
  ds = p * (dp - delta[:, None])
  if tanh is not None:
    ds = ds * (1.0 - tanh * tanh)
  return pd, ds


def _dq_kernel(*refs, plan: tp.Plan, names):
  r = dict(zip(names, refs))
  bq, bk = plan.block_q, plan.block_kv
  i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q, do = r["q"][...], r["do"][...]
  lse2, delta = r["lse"][...] * LOG2E, r["delta"][...]
  q_ids = r["q_ids"][pl.ds(i * bq, bq)] if "q_ids" in r else None

  def body(j, dq, positional):
    t = tiles(r, plan, i, j, bq, bk)
    k = r["k"][pl.ds(j * bk, bk), :]
    v = r["v"][pl.ds(j * bk, bk), :]
    _, ds = _p_ds(plan, r, t, q, k, v, do, lse2, delta, q_ids, b, h, i, j,
                  positional)
    if "ds" in r:
      r["ds"][:, pl.ds(j * bk, bk)] = ds
    return dq + tp.dot(ds.astype(k.dtype), k, plan)

  dq = stages(plan, *tp.narrow_to_segments(r, plan.kv_ranges(i), i), body,
              jnp.zeros((bq, plan.head_dim_padded), jnp.float32))
  r["dq"][...] = (dq * plan.spec.softmax_scale).astype(r["dq"].dtype)


def _dkv_kernel(*refs, plan: tp.Plan, names):
  r = dict(zip(names, refs))
  bq, bk = plan.block_q, plan.block_kv
  j, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k, v = r["k"][...], r["v"][...]

  def body(i, carry, positional):
    dk, dv = carry
    t = tiles(r, plan, i, j, bq, bk)
    rows = pl.ds(i * bq, bq)
    q, do = r["q"][rows, :], r["do"][rows, :]
    q_ids = r["q_ids"][rows] if "q_ids" in r else None
    pd, ds = _p_ds(plan, r, t, q, k, v, do, r["lse"][rows] * LOG2E,
                   r["delta"][rows], q_ids, b, h, i, j, positional)
    dv = dv + tp.dot(pd.T.astype(do.dtype), do, plan)
    dk = dk + tp.dot(ds.T.astype(q.dtype), q, plan)
    return dk, dv

  lo, lo_full, hi_full, hi = tp.narrow_to_segments(r, plan.q_ranges(j), j)
  dk, dv = stages(plan, lo, lo_full, hi_full, hi, body,
                  (jnp.zeros((bk, plan.head_dim_padded), jnp.float32),
                   jnp.zeros((bk, plan.head_dim_v_padded), jnp.float32)))
  r["dk"][...] = (dk * plan.spec.softmax_scale).astype(r["dk"].dtype)
  r["dv"][...] = dv.astype(r["dv"].dtype)


def backward(x: tp.KernelOperands, plan_dq: tp.Plan, plan_dkv: tp.Plan, cfg_dq,
             cfg_dkv, do, lse, delta, interpret, visible_dq=None, visible_dkv=None):
  """``do [B, Sqp, Hq, Dvp]``, ``lse, delta [B, Hq, Sqp]`` fp32. Returns dq, dk, dv
  (padded kernel layout; dk/dv fp32 per query head when grouped) and ds or None.
  ``visible_dq``/``visible_dkv``: the block ranges segment ids leave to each
  kernel (tp.visible_blocks), or None.

  Both plans must pad the sequences alike (their blocks divide one padding)."""
  spec = plan_dq.spec
  g = spec.group_size
  dp, dvp = plan_dq.head_dim_padded, plan_dq.head_dim_v_padded
  sqp, skp = plan_dq.seq_q_padded, plan_dq.seq_k_padded
  b_, hq = spec.batch, spec.heads_q
  rows_map = lambda i, b, h: (b, h, i)

  # -- dq --------------------------------------------------------------------------
  bq = plan_dq.block_q
  specs = [
      ("q", pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0)), x.q),
      ("k", pl.BlockSpec((None, skp, None, dp), lambda i, b, h: (b, 0, h // g, 0)), x.k),
      ("v", pl.BlockSpec((None, skp, None, dvp), lambda i, b, h: (b, 0, h // g, 0)),
       x.v),
      ("do", pl.BlockSpec((None, bq, None, dvp), lambda i, b, h: (b, i, h, 0)), do),
      ("lse", pl.BlockSpec((None, None, bq), rows_map), lse),
      ("delta", pl.BlockSpec((None, None, bq), rows_map), delta),
  ] + in_specs(x, plan_dq, pl.BlockSpec((None, sqp), lambda i, b, h: (b, 0)),
               pl.BlockSpec((None, skp), lambda i, b, h: (b, 0)),
               lambda i, b, h: (b, h))
  specs += segment_specs(visible_dq, lambda i, b, h: (b, 0))
  out_shape = [jax.ShapeDtypeStruct(x.q.shape, x.q.dtype)]
  out_specs = [pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0))]
  aliases = {}
  if x.bias is not None:
    # Tiles the band skips are never written: start from zeros.
    specs.append(("ds_init", pl.BlockSpec((None, None, bq, skp),
                                          lambda i, b, h: (b, h, i, 0)),
                  jnp.zeros((b_, hq, sqp, skp), jnp.float32)))
    aliases = {len(specs) - 1: 1}
    out_shape.append(jax.ShapeDtypeStruct((b_, hq, sqp, skp), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, bq, skp), lambda i, b, h: (b, h, i, 0)))
  names = [n for n, _, _ in specs] + ["dq"] + (["ds"] if x.bias is not None else [])
  res = pl.pallas_call(
      functools.partial(_dq_kernel, plan=plan_dq, names=names),
      grid=(plan_dq.num_q_blocks, b_, hq),
      in_specs=[s for _, s, _ in specs], out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=cfg_dq.num_warps,
                                           num_stages=cfg_dq.num_stages),
      interpret=interpret, name="flashjax_pallas_triton_bwd_dq",
  )(*(a for _, _, a in specs))
  dq, ds = res[0], (res[1] if x.bias is not None else None)

  # -- dk, dv ---------------------------------------------------------------------------
  bk = plan_dkv.block_kv
  kv_map = lambda j, b, h: (b, j, h // g, 0)
  whole_q = lambda j, b, h: (b, 0, h, 0)
  specs = [
      ("q", pl.BlockSpec((None, sqp, None, dp), whole_q), x.q),
      ("k", pl.BlockSpec((None, bk, None, dp), kv_map), x.k),
      ("v", pl.BlockSpec((None, bk, None, dvp), kv_map), x.v),
      ("do", pl.BlockSpec((None, sqp, None, dvp), whole_q), do),
      ("lse", pl.BlockSpec((None, None, sqp), lambda j, b, h: (b, h, 0)), lse),
      ("delta", pl.BlockSpec((None, None, sqp), lambda j, b, h: (b, h, 0)), delta),
  ] + in_specs(x, plan_dkv, pl.BlockSpec((None, sqp), lambda j, b, h: (b, 0)),
               # Whole rows: tiles() slices the kv tile itself.
               pl.BlockSpec((None, skp), lambda j, b, h: (b, 0)),
               lambda j, b, h: (b, h))
  specs += segment_specs(visible_dkv, lambda j, b, h: (b, 0))
  names = [n for n, _, _ in specs] + ["dk", "dv"]
  # Grouped heads: one partial per query head, summed per group by XLA in fp32.
  heads, dt_k, dt_v = (hq, jnp.float32, jnp.float32) if g > 1 else (
      spec.heads_kv, x.k.dtype, x.v.dtype)
  out_map = (lambda j, b, h: (b, j, h, 0)) if g > 1 else kv_map
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, plan=plan_dkv, names=names),
      grid=(plan_dkv.num_kv_blocks, b_, hq),
      in_specs=[s for _, s, _ in specs],
      out_specs=[pl.BlockSpec((None, bk, None, dp), out_map),
                 pl.BlockSpec((None, bk, None, dvp), out_map)],
      out_shape=[jax.ShapeDtypeStruct((b_, skp, heads, dp), dt_k),
                 jax.ShapeDtypeStruct((b_, skp, heads, dvp), dt_v)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg_dkv.num_warps,
                                           num_stages=cfg_dkv.num_stages),
      interpret=interpret, name="flashjax_pallas_triton_bwd_dkv",
  )(*(a for _, _, a in specs))
  if g > 1:
    group = lambda a, dt: a.reshape(b_, skp, spec.heads_kv, g, -1).sum(3).astype(dt)
    dk, dv = group(dk, x.k.dtype), group(dv, x.v.dtype)
  return dq, dk, dv, ds
