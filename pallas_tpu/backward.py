"""Backward kernels (FlashAttention-2, Alg. 2, split in two passes).

* dq: grid (B, Hq, q blocks, kv steps), kv "arbitrary": recomputes p from the
  saved lse, ``ds = p * (dp - delta)``, accumulates ``dq += ds @ k``. With a bias it
  also writes ds per (q, kv) block for dbias; then the kv axis walks every block
  (each block of ds written once, zeros where skipped).
* dkv: grid (B, Hkv, kv blocks, G * q steps), the last axis "arbitrary": one kv
  block accumulates ``dv += p^T @ do`` and ``dk += ds^T @ q`` over every query head
  of its group and every q block the band lets reach it (no K/V repetition).

``delta = rowsum(do * o) - dlse`` is computed by XLA beforehand; lse is the total
one (sinks included) with +inf for empty rows, so every p there is exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import dropout
from . import tile
from .forward import kv_block, kv_steps
from .plan import KernelOperands, Plan, broadcast_block, broadcast_index, segment_ranges


def _probs_and_ds(plan: Plan, refs: dict, b, h, i, j):
  """p (after dropout), ds (through the soft cap) of one tile."""
  spec = plan.spec
  q, k, v, do = refs["q"][...], refs["k"][...], refs["v"][...], refs["do"][...]
  s, t = tile.scores(plan, q, k, refs["bias"][...] if "bias" in refs else None)
  p = jnp.exp(s - refs["lse"][...])
  ok = tile.allowed(plan, i, j, refs["qid"][...] if "qid" in refs else None,
                    refs["kvid"][...] if "kvid" in refs else None,
                    refs["mask"][...] if "mask" in refs else None)
  if ok is not None:
    p = jnp.where(ok, p, 0.0)
  dp = tile.matmul_nt(do, v)
  pd = p
  if spec.dropout_rate > 0:
    keep = tile.dropout_keep(plan, refs["seed"], b, h, i, j)
    scale = dropout.keep_scale(spec.dropout_rate)
    pd = jnp.where(keep, p * scale, 0.0)
    dp = jnp.where(keep, dp * scale, 0.0)
  ds = p * (dp - refs["delta"][...])
  if t is not None:
    ds = ds * (1.0 - t * t)
  return pd, ds


def _unpack(refs, names):
  it = iter(refs)
  return {n: next(it) for n in names}


def _dq_kernel(*refs, plan: Plan, names, full_grid: bool):
  r = _unpack(refs, names)
  b, h, i, j = (pl.program_id(a) for a in range(4))
  lo, hi = r["lo"], r["hi"]
  jj = j if full_grid else lo[i] + j

  @pl.when(j == 0)
  def _init():
    r["dq_acc"][...] = jnp.zeros(r["dq_acc"].shape, jnp.float32)

  run = (jj >= lo[i]) & (jj < hi[i])
  if "qmin" in r:
    run = run & tile.segments_meet((r["qmin"], r["qmax"], r["kmin"], r["kmax"]),
                                   plan, b, i, jj)

  @pl.when(run)
  def _step():
    _, ds = _probs_and_ds(plan, r, b, h, i, jj)
    k = r["k"][...]
    r["dq_acc"][...] += tile.matmul(ds.astype(k.dtype), k) * plan.spec.softmax_scale
    if "ds" in r:
      r["ds"][...] = ds

  if "ds" in r:
    @pl.when(jnp.logical_not(run))
    def _skip():
      r["ds"][...] = jnp.zeros(r["ds"].shape, jnp.float32)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    r["dq"][...] = r["dq_acc"][...].astype(r["dq"].dtype)


def _dkv_kernel(*refs, plan: Plan, names, q_steps: int):
  r = _unpack(refs, names)
  b, hk, j, t = (pl.program_id(a) for a in range(4))
  g_idx, step = t // q_steps, t % q_steps
  h = hk * plan.spec.group_size + g_idx
  i = r["qlo"][j] + step

  @pl.when(t == 0)
  def _init():
    r["dk_acc"][...] = jnp.zeros(r["dk_acc"].shape, jnp.float32)
    r["dv_acc"][...] = jnp.zeros(r["dv_acc"].shape, jnp.float32)

  run = i < r["qhi"][j]
  if "qmin" in r:
    run = run & tile.segments_meet((r["qmin"], r["qmax"], r["kmin"], r["kmax"]),
                                   plan, b, i, j)

  @pl.when(run)
  def _step():
    pd, ds = _probs_and_ds(plan, r, b, h, i, j)
    do, q = r["do"][...], r["q"][...]
    r["dv_acc"][...] += tile.matmul(pd.astype(do.dtype), do, contract_lhs=0)
    r["dk_acc"][...] += tile.matmul(ds.astype(q.dtype), q,
                                    contract_lhs=0) * plan.spec.softmax_scale

  @pl.when(t == pl.num_programs(3) - 1)
  def _finish():
    r["dk"][...] = r["dk_acc"][...].astype(r["dk"].dtype)
    r["dv"][...] = r["dv_acc"][...].astype(r["dv"].dtype)


def _q_ranges_steps(plan: Plan) -> int:
  lo, hi = plan.q_block_ranges()
  return max(1, int((hi - lo).max()))


def backward(x: KernelOperands, plan: Plan, do, lse, delta, *, interpret=None):
  """``do [B, Hq, Sqp, Dv]``, ``lse, delta [B, Hq, Sqp, 1]`` fp32 (lse total,
  +inf on empty rows). Returns dq, dk, dv in kernel layout and the full fp32 ds
  ``[B, Hq, Sqp, Skp]`` when there is a bias (else None)."""
  spec = plan.spec
  bq, bk, g = plan.block_q, plan.block_kv, spec.group_size
  d, dv_dim = spec.head_dim, spec.head_dim_v
  b_, hq, hkv = spec.batch, spec.heads_q, spec.heads_kv
  seg = segment_ranges(x, plan)
  params = pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

  # -- dq (and ds) -----------------------------------------------------------------
  kv_lo, kv_hi = (jnp.asarray(a) for a in plan.kv_block_ranges())
  full_grid = x.bias is not None
  prefetch = {"lo": kv_lo, "hi": kv_hi}
  if seg is not None:
    prefetch.update(zip(("qmin", "qmax", "kmin", "kmax"), seg))
  if x.seed is not None:
    prefetch["seed"] = x.seed

  def kv_of(i, j, lo, hi):
    if full_grid:  # walk all blocks; clamp only the loads
      return jnp.clip(j, lo[i], jnp.maximum(hi[i] - 1, lo[i]))
    return kv_block(i, j, lo, hi)

  row = lambda b, h, i, j, *_: (b, h, i, 0)
  kv_map = lambda b, h, i, j, lo, hi, *_: (b, h // g, kv_of(i, j, lo, hi), 0)
  specs = {"q": (pl.BlockSpec((None, None, bq, d), row), x.q),
           "k": (pl.BlockSpec((None, None, bk, d), kv_map), x.k),
           "v": (pl.BlockSpec((None, None, bk, dv_dim), kv_map), x.v),
           "do": (pl.BlockSpec((None, None, bq, dv_dim), row), do),
           "lse": (pl.BlockSpec((None, None, bq, 1), row), lse),
           "delta": (pl.BlockSpec((None, None, bq, 1), row), delta)}
  for name, arr in (("bias", x.bias), ("mask", x.mask)):
    if arr is not None:
      specs[name] = (pl.BlockSpec(
          broadcast_block(arr.shape, plan),
          lambda b, h, i, j, lo, hi, *_, shape=arr.shape: broadcast_index(
              shape, b, h, i, kv_of(i, j, lo, hi))), arr)
  if seg is not None:
    specs["qid"] = (pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *_: (b, i, 0)),
                    x.q_ids)
    specs["kvid"] = (pl.BlockSpec((None, 1, bk), lambda b, h, i, j, lo, hi, *_: (
        b, 0, kv_of(i, j, lo, hi))), x.kv_ids)
  outs = {"dq": (pl.BlockSpec((None, None, bq, d), row),
                 jax.ShapeDtypeStruct(x.q.shape, x.q.dtype))}
  if full_grid:
    outs["ds"] = (pl.BlockSpec((None, None, bq, bk), lambda b, h, i, j, *_: (
        b, h, i, j)), jax.ShapeDtypeStruct(
            (b_, hq, plan.seq_q_padded, plan.seq_k_padded), jnp.float32))
  names = list(prefetch) + list(specs) + list(outs) + ["dq_acc"]
  steps = plan.num_kv_blocks if full_grid else kv_steps(plan)
  res = pl.pallas_call(
      functools.partial(_dq_kernel, plan=plan, names=names, full_grid=full_grid),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(b_, hq, plan.num_q_blocks, steps),
          in_specs=[s for s, _ in specs.values()],
          out_specs=[s for s, _ in outs.values()],
          scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
      out_shape=[o for _, o in outs.values()], compiler_params=params,
      interpret=interpret or False, name="flashjax_tpu_bwd_dq",
  )(*prefetch.values(), *(a for _, a in specs.values()))
  dq, ds = res[0], (res[1] if full_grid else None)

  # -- dk, dv ------------------------------------------------------------------------
  q_lo, q_hi = (jnp.asarray(a) for a in plan.q_block_ranges())
  q_steps = _q_ranges_steps(plan)
  prefetch = {"qlo": q_lo, "qhi": q_hi}
  if seg is not None:
    prefetch.update(zip(("qmin", "qmax", "kmin", "kmax"), seg))
  if x.seed is not None:
    prefetch["seed"] = x.seed

  def q_of(j, t, qlo, qhi):
    return jnp.minimum(qlo[j] + t % q_steps, jnp.maximum(qhi[j] - 1, qlo[j]))

  qrow = lambda b, hk, j, t, qlo, qhi, *_: (b, hk * g + t // q_steps,
                                            q_of(j, t, qlo, qhi), 0)
  kv_own = lambda b, hk, j, t, *_: (b, hk, j, 0)
  specs = {"q": (pl.BlockSpec((None, None, bq, d), qrow), x.q),
           "k": (pl.BlockSpec((None, None, bk, d), kv_own), x.k),
           "v": (pl.BlockSpec((None, None, bk, dv_dim), kv_own), x.v),
           "do": (pl.BlockSpec((None, None, bq, dv_dim), qrow), do),
           "lse": (pl.BlockSpec((None, None, bq, 1), qrow), lse),
           "delta": (pl.BlockSpec((None, None, bq, 1), qrow), delta)}
  for name, arr in (("bias", x.bias), ("mask", x.mask)):
    if arr is not None:
      specs[name] = (pl.BlockSpec(
          broadcast_block(arr.shape, plan),
          lambda b, hk, j, t, qlo, qhi, *_, shape=arr.shape: broadcast_index(
              shape, b, hk * g + t // q_steps, q_of(j, t, qlo, qhi), j)), arr)
  if seg is not None:
    specs["qid"] = (pl.BlockSpec((None, bq, 1), lambda b, hk, j, t, qlo, qhi, *_: (
        b, q_of(j, t, qlo, qhi), 0)), x.q_ids)
    specs["kvid"] = (pl.BlockSpec((None, 1, bk), lambda b, hk, j, t, *_: (b, 0, j)),
                     x.kv_ids)
  outs = {"dk": (pl.BlockSpec((None, None, bk, d), kv_own),
                 jax.ShapeDtypeStruct(x.k.shape, x.k.dtype)),
          "dv": (pl.BlockSpec((None, None, bk, dv_dim), kv_own),
                 jax.ShapeDtypeStruct(x.v.shape, x.v.dtype))}
  names = list(prefetch) + list(specs) + list(outs) + ["dk_acc", "dv_acc"]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, plan=plan, names=names, q_steps=q_steps),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(b_, hkv, plan.num_kv_blocks, g * q_steps),
          in_specs=[s for s, _ in specs.values()],
          out_specs=[s for s, _ in outs.values()],
          scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32),
                          pltpu.VMEM((bk, dv_dim), jnp.float32)]),
      out_shape=[o for _, o in outs.values()], compiler_params=params,
      interpret=interpret or False, name="flashjax_tpu_bwd_dkv",
  )(*prefetch.values(), *(a for _, a in specs.values()))
  return dq, dk, dv, ds
