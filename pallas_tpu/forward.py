"""Forward kernel: online softmax over kv blocks; grid (B, Hq, q blocks, kv steps).

The kv axis walks only the blocks the band can reach: step ``j`` of q block ``i``
is kv block ``lo[i] + j`` (scalar-prefetched tables), clamped so that steps past
``hi[i]`` keep the previous block index: Pallas then issues no DMA for them, and
``pl.when`` skips their compute. Blocks whose segment-id ranges cannot meet are
skipped the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import dropout
from . import tile
from .config import NUM_LANES
from .plan import Plan, KernelOperands, broadcast_block, broadcast_index, segment_ranges


def kv_steps(plan: Plan) -> int:
  lo, hi = plan.kv_block_ranges()
  return max(1, int((hi - lo).max()))


def kv_block(i, j, lo, hi):
  """Absolute kv block of step j (clamped into the row's range, no new DMA)."""
  return jnp.minimum(lo[i] + j, jnp.maximum(hi[i] - 1, lo[i]))


def _kernel(*refs, plan: Plan, has: dict, count: bool):
  spec = plan.spec
  it = iter(refs)
  lo, hi = next(it), next(it)
  seg = tuple(next(it) for _ in range(4)) if has["segments"] else None
  seed = next(it) if has["dropout"] else None
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  bias_ref = next(it) if has["bias"] else None
  mask_ref = next(it) if has["mask"] else None
  qid_ref, kvid_ref = (next(it), next(it)) if seg is not None else (None, None)
  o_ref, lse_ref = next(it), next(it)
  cnt_ref = next(it) if count else None
  m_sc, l_sc, acc_sc = next(it), next(it), next(it)

  b, h, i, j = (pl.program_id(a) for a in range(4))
  jj = lo[i] + j

  pl.when(j == 0)(lambda: tile.init_rows(m_sc, l_sc, acc_sc, cnt_ref))

  run = jj < hi[i]
  if seg is not None:
    run = run & tile.segments_meet(seg, plan, b, i, jj)

  @pl.when(run)
  def _step():
    s, _ = tile.scores(plan, q_ref[...], k_ref[...],
                       None if bias_ref is None else bias_ref[...])
    ok = tile.allowed(plan, i, jj, None if qid_ref is None else qid_ref[...],
                      None if kvid_ref is None else kvid_ref[...],
                      None if mask_ref is None else mask_ref[...])
    if ok is not None:
      s = jnp.where(ok, s, -jnp.inf)
    p, alpha = tile.online_softmax(s, m_sc, l_sc)
    if seed is not None:
      p = jnp.where(tile.dropout_keep(plan, seed, b, h, i, jj), p, 0.0)
    v = v_ref[...]
    acc_sc[...] = alpha * acc_sc[...] + tile.matmul(p.astype(v.dtype), v)
    if cnt_ref is not None:
      cnt_ref[...] += 1

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    out, lse = tile.finish_rows(acc_sc, m_sc, l_sc,
                                 dropout.keep_scale(spec.dropout_rate))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def forward(x: KernelOperands, plan: Plan, *, interpret=None, count: bool = False):
  """Returns ``out [B, Hq, Sqp, Dv]``, ``lse [B, Hq, Sqp, 1]`` (rows only, no
  sinks) and, with ``count``, executed kv steps ``[B, Hq, nq, 1]``."""
  spec = plan.spec
  bq, bk, g = plan.block_q, plan.block_kv, spec.group_size
  lo, hi = (jnp.asarray(t) for t in plan.kv_block_ranges())
  prefetch = [lo, hi]
  seg = segment_ranges(x, plan)
  if seg is not None:
    prefetch += list(seg)
  if x.seed is not None:
    prefetch.append(x.seed)
  n_pre = len(prefetch)
  has = dict(segments=seg is not None, dropout=x.seed is not None,
             bias=x.bias is not None, mask=x.mask is not None)

  def kv_map(b, h, i, j, lo, hi, *_):
    return (b, h // g, kv_block(i, j, lo, hi), 0)

  in_specs = [
      pl.BlockSpec((None, None, bq, spec.head_dim), lambda b, h, i, j, *_: (b, h, i, 0)),
      pl.BlockSpec((None, None, bk, spec.head_dim), kv_map),
      pl.BlockSpec((None, None, bk, spec.head_dim_v), kv_map),
  ]
  inputs = [x.q, x.k, x.v]
  for arr in (x.bias, x.mask):
    if arr is not None:
      shape = arr.shape
      in_specs.append(pl.BlockSpec(
          broadcast_block(shape, plan),
          lambda b, h, i, j, lo, hi, *_, shape=shape: broadcast_index(
              shape, b, h, i, kv_block(i, j, lo, hi))))
      inputs.append(arr)
  if seg is not None:
    in_specs += [
        pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *_: (b, i, 0)),
        pl.BlockSpec((None, 1, bk), lambda b, h, i, j, lo, hi, *_: (
            b, 0, kv_block(i, j, lo, hi)))]
    inputs += [x.q_ids, x.kv_ids]

  b_, hq, sqp = spec.batch, spec.heads_q, plan.seq_q_padded
  out_shape = [jax.ShapeDtypeStruct((b_, hq, sqp, spec.head_dim_v), x.q.dtype),
               jax.ShapeDtypeStruct((b_, hq, sqp, 1), jnp.float32)]
  row_map = lambda b, h, i, j, *_: (b, h, i, 0)
  out_specs = [pl.BlockSpec((None, None, bq, spec.head_dim_v), row_map),
               pl.BlockSpec((None, None, bq, 1), row_map)]
  if count:
    out_shape.append(jax.ShapeDtypeStruct((b_, hq, plan.num_q_blocks, 1), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, 1, 1), row_map))

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=n_pre,
      grid=(b_, hq, plan.num_q_blocks, kv_steps(plan)),
      in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                      pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                      pltpu.VMEM((bq, spec.head_dim_v), jnp.float32)])
  kernel = functools.partial(_kernel, plan=plan, has=has, count=count)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret or False, name="flashjax_tpu_fwd",
  )(*prefetch, *inputs)

