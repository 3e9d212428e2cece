"""Mosaic-GPU single-pass backward for Hopper: dK, dV and dQ from one kernel,
five block products per step instead of the seven of mosaic_bwd's two kernels.

The CTA is the dK/dV kernel's (two compute warpgroups of ``block_kv`` keys each, a
memory warpgroup streaming Q, dO and the row stats), and each step adds
FlashAttention-3's dQ:

  dQ[rows of step s] += dS K   (over the CTA's 2 * block_kv keys),

with dS^T of both warpgroups written to shared memory and each warpgroup computing
half of dQ's columns over both halves of the keys (D >= 128; at D = 64 a
32-column tile would cut a 128-byte swizzle atom, so there each warpgroup
computes all columns over its own keys). The partial goes through an fp32
staging tile to global memory by TMA reduce-add; partials of different CTAs land
in any order, so dQ is not bit-reproducible (``MosaicConfig(deterministic=True)``
selects the two kernels).

Why the dQ product of step s runs in step s + 1: it needs the other warpgroup's
dS^T. Waiting for it in the same step puts the warpgroups in lock step, and then
both do their softmax at once while the tensor cores idle (commit a005032
measured this 5-20% slower than two kernels). One step later the other
warpgroup's dS^T is normally long written, so the wait costs nothing, and the
two warpgroups keep drifting against each other. Two dS^T buffers (by step
parity) with ``ready`` and ``free`` barriers carry the hand-over.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ..common import compat
from ..common.mask import band_allowed
from . import mosaic_pipeline
from .mosaic_blocks import Geometry, cta_q_ranges
from .mosaic_bwd import _dscores, _index, _probs


def split_columns(g: Geometry) -> bool:
  return g.head_dim >= 128


def _program(g: Geometry, dtype):
  bq, bk, d, stages = g.block_q, g.block_kv, g.head_dim, g.stages
  exp = set(os.environ.get("FJX_FUSED_EXP", "").split(","))  # EXPERIMENT switches
  rotate = "rot" in exp and g.band.is_full
  tiles, dbl = "tiles" in exp, "dbl" in exp
  split = split_columns(g)
  cols_n = d // 2 if split else d

  def kernel(q_ref, k_ref, v_ref, do_ref, st_ref, dq_ref, dk_ref, dv_ref, where,
             smem, bars, free):
    q_free, do_free = free
    tile, h, b_idx = where
    wg = lax.axis_index("wg")
    q_smem, do_smem, st_smem, k_smem, v_smem, ds_smem, dq_smem = smem
    q_bar, do_bar, st_bar, k_bar, v_bar, ds_ready, ds_free, done = bars
    ranges, lo_c, hi_c = cta_q_ranges(g, tile)
    n_walk = jnp.maximum(hi_c - lo_c, 1)
    rot = lax.rem(tile * n_walk // g.num_kv_tiles, n_walk)
    walk = (lambda i: lo_c + lax.rem(i - lo_c + rot, n_walk)) if rotate else (
        lambda i: i)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      pick = lambda i: jnp.where(wg == 0, ranges[0][i], ranges[1][i])
      lo, a, bb, hi = (pick(i) for i in range(4))
      k0 = tile * (2 * bk) + wg * bk
      kv_h = lax.div(h, jnp.int32(g.group))
      my_k, my_v = k_smem.at[wg], v_smem.at[wg]
      rows = (b_idx, pl.ds(k0, bk), kv_h)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], my_k, k_bar.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], my_v, v_bar.at[wg])
      zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32),
                                              plgpu.Layout.WGMMA)
      col = lambda x: lax.broadcast_in_dim(x, (bk, bq), [1])
      cols = pl.ds(wg * cols_n, cols_n) if split else pl.ds(0, d)
      srcs = (0, 1) if split else (None,)
      parity = lambda s: lax.rem(s - lo_c + 2, jnp.int32(2))

      # The step before the walk hands over zeros, so every step has a previous
      # one and the loop body needs no branch around its wgmma.
      ds_smem.at[1, wg][...] = zeros((bk, bq)).astype(dtype)
      plgpu.commit_smem()
      if split:
        plgpu.barrier_arrive(ds_ready.at[1])
      plgpu.barrier_wait(k_bar.at[wg])
      plgpu.barrier_wait(v_bar.at[wg])
      if split:  # this warpgroup's dQ columns read the other's keys too
        plgpu.barrier_wait(k_bar.at[1 - wg])

      def dq_of_previous(s):
        """dQ partial of step ``s - 1`` from the dS^T in shared memory (issued
        after this step's dK, which the wait at its end also completes); the
        staging tile is reduced into dq unless ``s - 1`` is the zero step."""
        prev = parity(s - 1)
        if split and "nowait" not in exp:
          plgpu.barrier_wait(ds_ready.at[prev])

        def product(acc_ref):
          for w in srcs:
            src = wg if w is None else w
            plgpu.wgmma(acc_ref, compat.transpose_ref(ds_smem.at[prev, src], (1, 0)),
                        k_smem.at[src, :, cols])
          return acc_ref[...]

        if "nodq" in exp:
          part = zeros((bq, cols_n))
        else:
          part = pl.run_scoped(product, plgpu.ACC((bq, cols_n), jnp.float32))
        if split:
          plgpu.barrier_arrive(ds_free.at[prev])
        # The previous reduce-add must have read the staging tile.
        plgpu.wait_smem_to_gmem(1 if dbl else 0, wait_read_only=True)
        stage = dq_smem.at[wg, parity(s)] if dbl else dq_smem.at[wg]
        stage[...] = part
        plgpu.commit_smem()

        @pl.when((s > lo_c) & ("noreduce" not in exp))
        def _():
          dst_ref = (dq_ref.at[b_idx, h, walk(s - 1), wg if split else 0] if tiles
                     else dq_ref.at[b_idx, pl.ds(walk(s - 1) * bq, bq), h, cols])
          plgpu.copy_smem_to_gmem(stage, dst_ref, reduction_op="add")

      def hand_over(s, dst):
        """Writes this step's dS^T for both warpgroups' dQ products."""
        par = parity(s)
        if split and "nowait" not in exp:
          pl.when(s > lo_c)(lambda: plgpu.barrier_wait(ds_free.at[par]))
        ds_smem.at[par, wg][...] = dst
        plgpu.commit_smem()
        if split:
          plgpu.barrier_arrive(ds_ready.at[par])

      def step(i, carry, masked: bool):
        dk, dv = carry
        s = walk(i)
        slot = lax.rem(i - lo_c, jnp.int32(stages))
        my_q, my_do = q_smem.at[slot], do_smem.at[slot]
        plgpu.barrier_wait(q_bar.at[slot])

        def st_product(acc_ref):
          plgpu.wgmma(acc_ref, my_k, compat.transpose_ref(my_q, (1, 0)))
          return acc_ref[...]

        st = pl.run_scoped(st_product, plgpu.ACC((bk, bq), jnp.float32))
        plgpu.barrier_wait(st_bar.at[slot])
        lse2 = compat.mgpu_load(st_smem.at[slot, 0], plgpu.Layout.WGMMA.reduce(0))
        delta = compat.mgpu_load(st_smem.at[slot, 1], plgpu.Layout.WGMMA.reduce(0))
        pt, tanh = _probs(st, col(lse2), g)
        if masked:  # also zero on this warpgroup's skip steps: the band excludes all
          keys, qrows = _index((bk, bq), 0, k0), _index((bk, bq), 1, s * bq)
          pt = jnp.where(band_allowed(qrows, keys, g.band), pt, 0.0)
        plgpu.barrier_wait(do_bar.at[slot])

        def products(refs):
          dpt_ref, dv_ref, dk_ref = refs
          plgpu.wgmma(dpt_ref, my_v, compat.transpose_ref(my_do, (1, 0)))
          plgpu.wgmma(dv_ref, pt.astype(dtype), my_do)
          dpt = plgpu.wgmma_accumulator_load(dpt_ref, wait_n=1)
          dst = _dscores(pt, dpt, col(delta), tanh).astype(dtype)
          plgpu.wgmma(dk_ref, dst, my_q)
          hand_over(i, dst)
          plgpu.wgmma_wait(1)
          plgpu.barrier_arrive(do_free.at[slot])
          dq_of_previous(i)

        _, dv, dk = pl.run_state(products)(
            (plgpu.ACC.init(zeros((bk, bq))), plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

      carry = (zeros((bk, d)), zeros((bk, d)))
      # A warpgroup's skip steps run masked (all zero) since the other one's dQ
      # columns need its dS^T; outside a band's edge rows that is one step.
      carry = lax.fori_loop(lo_c, a, lambda s, c: step(s, c, True), carry)
      carry = lax.fori_loop(a, bb, lambda s, c: step(s, c, False), carry)
      carry = lax.fori_loop(bb, hi_c, lambda s, c: step(s, c, True), carry)
      dk, dv = carry
      dq_of_previous(hi_c)

      # K is read by the other warpgroup's dQ products until both are done.
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
      my_k[...] = (dk * g.softmax_scale).astype(dtype)
      my_v[...] = dv.astype(dtype)
      plgpu.commit_smem()
      out_rows = (b_idx, pl.ds(k0, bk), h)
      plgpu.copy_smem_to_gmem(my_k, dk_ref.at[out_rows])
      plgpu.copy_smem_to_gmem(my_v, dv_ref.at[out_rows])
      plgpu.wait_smem_to_gmem(0)

    def load_do(i, slot):
      s = walk(i)
      plgpu.copy_gmem_to_smem(do_ref.at[b_idx, pl.ds(s * bq, bq), h],
                              do_smem.at[slot], do_bar.at[slot])

    def load_q(i, slot):
      s = walk(i)
      plgpu.copy_gmem_to_smem(q_ref.at[b_idx, pl.ds(s * bq, bq), h],
                              q_smem.at[slot], q_bar.at[slot])
      plgpu.copy_gmem_to_smem(st_ref.at[b_idx, h, :, pl.ds(s * bq, bq)],
                              st_smem.at[slot], st_bar.at[slot])

    pl.when(wg == 2)(lambda: mosaic_pipeline.produce(
        lo_c, hi_c, stages, ((do_free, load_do), (q_free, load_q))))

  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  smem = (
      plgpu.SMEM((stages, bq, d), dtype, transforms=tiled),
      plgpu.SMEM((stages, bq, d), dtype, transforms=tiled),
      plgpu.SMEM((stages, 2, bq), jnp.float32),
      plgpu.SMEM((2, bk, d), dtype, transforms=tiled),
      plgpu.SMEM((2, bk, d), dtype, transforms=tiled),
      # dS^T by step parity and warpgroup; one fp32 dQ staging tile per warpgroup.
      plgpu.SMEM((2, 2, bk, bq), dtype, transforms=tiled),
      plgpu.SMEM((2, 2, bq, cols_n) if dbl else (2, bq, cols_n), jnp.float32,
                 transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
  )
  bars = tuple(plgpu.Barrier(num_barriers=n) for n in (stages, stages, stages, 2, 2))
  bars += (plgpu.Barrier(num_arrivals=2, num_barriers=2),
           plgpu.Barrier(num_arrivals=2, num_barriers=2),
           plgpu.Barrier(num_arrivals=2))
  free = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2
  return (smem, bars, free), kernel


def _dq_dkv(q, k, v, do, stats, g: Geometry):
  scoped, kernel = _program(g, q.dtype)
  dtype, d = q.dtype, g.head_dim

  def entry(*refs):
    where = (lax.axis_index("kt"), lax.axis_index("h"), lax.axis_index("b"))
    pl.run_scoped(lambda *sc: kernel(*refs, where, *sc), *scoped, collective_axes="wg")

  mesh = plgpu.Mesh(grid=(g.num_kv_tiles, g.heads_q, g.batch),
                    grid_names=("kt", "h", "b"), num_threads=3, thread_name="wg")
  params = plgpu.CompilerParams(approx_math=True)

  # The reduce-add target must start at zero, so it (with dK and dV) is a ref the
  # kernel mutates; run_state turns the refs back into values.
  def run(refs):
    pl.kernel(entry, out_type=(), mesh=mesh, compiler_params=params)(
        q, k, v, do, stats, *refs)

  kv_shape = (g.batch, g.seq_k_padded, g.heads_q, d)
  exp = set(os.environ.get("FJX_FUSED_EXP", "").split(","))
  if "tiles" in exp:
    nsplit = 2 if split_columns(g) else 1
    dq = jnp.zeros((g.batch, g.heads_q, g.seq_q_padded // g.block_q, nsplit,
                    g.block_q, d // nsplit), jnp.float32)
  else:
    dq = jnp.zeros((g.batch, g.seq_q_padded, g.heads_q, d), jnp.float32)
  dq, dk, dv = pl.run_state(run)((dq, jnp.empty(kv_shape, dtype),
                                  jnp.empty(kv_shape, dtype)))
  if "tiles" in exp:
    dq = dq.transpose(0, 2, 4, 1, 3, 5).reshape(g.batch, g.seq_q_padded, g.heads_q, d)
  return dq, dk, dv


def dq_dkv(q, k, v, do, stats, g: Geometry):
  """``q, do [B, Sqp, Hq, D]``, ``k, v [B, Skp, Hkv, D]`` (padded as for
  mosaic_bwd.dkv), ``stats [B, Hq, 2, Sqp]``. Returns ``(dq, dk, dv)``: dq fp32 and
  not yet scaled by the softmax scale, dk and dv per query head in q's dtype.

  The kernel's mutable dQ cannot be batched, so under vmap the mapped axis is
  folded into the batch axis, which every operand leads with."""

  @jax.custom_batching.custom_vmap
  def run(q, k, v, do, stats):
    return _dq_dkv(q, k, v, do, stats, g)

  @run.def_vmap
  def _fold(axis_size, in_batched, *args):
    args = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
            for x, b in zip(args, in_batched)]
    flat = [x.reshape((axis_size * x.shape[1],) + x.shape[2:]) for x in args]
    out = dq_dkv(*flat, dataclasses.replace(g, batch=axis_size * g.batch))
    return tuple(x.reshape((axis_size, g.batch) + x.shape[1:]) for x in out), (True,) * 3

  return run(q, k, v, do, stats)
