"""Mosaic-GPU backward kernels for Hopper: dK/dV (key-stationary) and dQ
(query-stationary), FlashAttention-2's backward split in two so that dQ, dK and
dV need no atomics and are deterministic; and the single pass (below), the
dK/dV kernel with dQ added by atomic reduce-adds. dbias's batch sum (below) is
the two kernels' one place with atomic adds.

dK/dV kernel.

One CTA owns ``2 * block_kv`` keys of one (batch, kv head). Two compute
warpgroups each keep ``block_kv`` keys of K and V in shared memory and their dK and
dV accumulators in registers; a memory warpgroup streams the query blocks that
reach either warpgroup's keys (Q, dO and each row's lse and delta) through a ring of
shared-memory slots with TMA. Per query block a warpgroup runs, on the tensor cores
(wgmma):

  S^T = K Q^T,  P^T = exp2(S^T * scale * log2(e) - lse * log2(e)),
  dV += P^T dO,  dP^T = V dO^T,  dS^T = P^T (dP^T - delta),  dK += dS^T Q.

Working on the transposes keeps every product's left operand either in shared
memory (K, V) or in registers (P^T, dS^T), as wgmma requires, with no transpose of
a register tile. Band blocks: each warpgroup splits the CTA's walk into skip /
masked / plain / masked / skip phases, like the forward (blocks.band_walk); skip
steps still wait for the slot's data and release it so barrier phases stay in
step.

With grouped heads the CTA walks the query blocks of each query head of its kv
head in turn, one pipeline step count across them, and its registers sum dK and
dV over the group in fp32. Per-query-head bf16 outputs summed by XLA would round
each head's share (the mean error against fp32 18-20% higher on an H200,
2026-11-29) and move the group's outputs through memory twice.

By default both kernels run as one launch (:func:`dq_dkv`): every dK/dV CTA, then
every dQ CTA, so the two grids share one tail.

Single pass (:func:`single_pass`, ``MosaicConfig.bwd_single_pass``): the dK/dV
kernel alone, which also adds each step's dQ partial into a zeroed fp32 dQ by
TMA reduce-adds (:func:`_single_pass_dq`): five block products per step instead
of seven, at the price of dQ's last bits varying between runs.

Above D = 128 (``Geometry.shared_block``) one warpgroup's registers hold one
64 x 256 fp32 accumulator but not two, so a CTA owns one block, which its two
compute warpgroups share in two roles (see :func:`_dkv_program`,
:func:`_dq_program`): one computes the probabilities and hands them over
through shared memory, the other the dP side; no product is computed twice.

dQ kernel: the forward's layout (two compute warpgroups of ``block_q`` rows, a
memory warpgroup streaming K and V blocks), with S = Q K^T, P = exp2(S * scale *
log2(e) - lse * log2(e)), dP = dO V^T, dS = P (dP - delta), dQ += dS K per block.

Segment ids (``Geometry.segments``), as in the forward: each warpgroup's walk is
cut to the blocks whose ids can meet its own (a ``[B, 4, n]`` table per
warpgroup block), blocks of more than the warpgroup's own id are masked; the ids
of a warpgroup's own rows (keys) come once, the streamed side's with each slot.
With contiguous segments (``Geometry.segment_spans``), every kernel compares
positions with its own rows' (keys') spans instead and streams no ids, as the
forward does.

Dropout (``Geometry.dropout_rate``): each row's dropout key (common/dropout.py,
hashed in XLA) rides in the row stats as two exact 16-bit halves, so the dK/dV
kernel, which meets new rows every step, and the dQ kernel hash each element
with dropout.mix_element only. dV takes the kept probabilities and dS the kept
dP, both scaled by 1 / (1 - rate).

Bias and dense mask (``Geometry.bias_dtype``, head dims up to 128): the
forward's additive tile (mosaic.additive_tile) comes with each K block in the
dQ kernel and with each Q block in the dK/dV kernel, which reads its blocks
transposed (pipeline.slot_tile: in registers, not by a copy of the tile). With a
bias (``Geometry.bias_grad``) the dQ kernel writes dS, the logits' gradient, to
a ``[B, Hq, Sqp, Skp]`` array for dbias (bf16 with a bf16 tile, else fp32;
:func:`ds_dtype`; summed in fp32 by XLA), zeros where its walk does not reach;
where it is summed over the batch or heads, those tiles stay unwritten and the
sum (a Pallas-Triton kernel, mosaic/dbias_sum.py) reads only the reached
ones, writing zeros elsewhere (``Geometry.ds_reached_only``).
A bias broadcast over eight or more batch rows (``Geometry.ds_batch_sum``) is
summed by the dQ kernel instead: fp32 TMA reduce-adds of each row's dS into one
zeroed ``[1, Hq, Sqp, Skp]`` array, with the dQ CTAs batch-fastest so the adds
to a tile meet in L2. The order of those fp32 adds is not fixed, so dbias's
last bits may vary from run to run; dQ, dK and dV stay deterministic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ...common import compat, dropout
from ...common.blocking import LOG2E
from . import pipeline
from .blocks import (Geometry, additive_tiling, band_walk, cta_block_ranges,
                     cta_q_ranges, dropout_col_keys, dropout_keep,
                     dropout_keys_from_halves, positions, windows)


def _probs(scores, lse2, g: Geometry, bias=None):
  """p = exp2(logits * log2(e) - lse2) from raw QK^T scores (``lse2`` already
  broadcast) and the additive tile ``bias`` (or None), logits being ``scale *
  s + bias`` soft-capped as in the forward; and tanh of the soft cap for the
  chain rule (or None)."""
  if g.soft_cap is None:
    if bias is None:
      return jnp.exp2(scores * (g.softmax_scale * LOG2E) - lse2), None
    return jnp.exp2((scores * g.softmax_scale + bias) * LOG2E - lse2), None
  logits = scores * g.softmax_scale
  if bias is not None:
    logits = logits + bias
  tanh = jnp.tanh(logits * (1.0 / g.soft_cap))
  return jnp.exp2(tanh * (g.soft_cap * LOG2E) - lse2), tanh


def _dscores(p, dp, delta, tanh):
  """dS = P (dP - delta), through the soft cap when there is one."""
  ds = p * (dp - delta)
  return ds if tanh is None else ds * (1.0 - tanh * tanh)


def _index(shape, dim, start):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA) + start


def _stat_rows(g: Geometry) -> int:
  """Rows of the per-row stats: lse (log2 units) and delta, and with dropout the
  two 16-bit halves of each row's dropout key (mosaic.backward)."""
  return 4 if g.dropout_rate else 2


def _load_row_keys(st, layout):
  """The dropout row keys from rows 2 and 3 of a block's stats in shared memory."""
  return dropout_keys_from_halves(compat.mgpu_load(st.at[2], layout),
                                  compat.mgpu_load(st.at[3], layout))


def _dropped(keep, x, scale=None):
  """``x`` (times ``scale``) where the dropout keeps, 0 where it drops; ``x``
  without dropout (``keep`` None)."""
  if keep is None:
    return x
  return jnp.where(keep, x if scale is None else x * scale, 0.0)


def _product_over_halves(a, b, shape):
  """``a b^T`` (fp32, ``shape``) of two blocks held as column halves (``[2,
  rows, D / 2]``): one wgmma per half, accumulated. The halves are indexed
  inside the ``pl.run_scoped`` body: a ref indexed by a constant and closed over
  by ``pl.run_state`` fails to lower (jax 0.11)."""
  def product(acc_ref):
    for i in range(2):
      plgpu.wgmma(acc_ref, a.at[i], compat.transpose_ref(b.at[i], (1, 0)))
    return acc_ref[...]
  return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _copy_half(g: Geometry, ref, rows, i, dst, bar):
  """Copies column half ``i`` of the ``(rows, D)`` block ``ref[rows]`` into
  ``dst``. The columns go in the same index as the rows: jax 0.11's Mosaic-GPU
  lowering failed on a column slice of a sliced ref inside a loop."""
  h = g.head_dim // 2
  plgpu.copy_gmem_to_smem(ref.at[rows + (pl.ds(i * h, h),)], dst, bar)


def _copy_halves(g: Geometry, ref, rows, slot, bar):
  """Both column halves of ``ref[rows]`` into a two-part ``slot``, on one barrier
  (which then expects two arrivals)."""
  for i in range(2):
    _copy_half(g, ref, rows, i, slot.at[i], bar)


def _handover(p, tanh, keep):
  """What the dS warpgroup of a kernel with roles needs of P (or P^T): P times
  the soft cap's ``1 - tanh^2``, negated where dropout drops, so that
  :func:`_dscores_from_handover` gives dS from it and dP alone."""
  hand = p if tanh is None else p * (1.0 - tanh * tanh)
  return hand if keep is None else jnp.where(keep, hand, -hand)


def _dscores_from_handover(hand, dp, delta, g: Geometry):
  """dS = P (dP - delta) (through the soft cap and the dropout) from
  :func:`_handover`'s value."""
  if g.dropout_rate:
    dp = jnp.where(hand > 0.0, dp * dropout.keep_scale(g.dropout_rate), 0.0)
    hand = jnp.abs(hand)
  return hand * (dp - delta)


def registers(g: Geometry) -> tuple[int, int]:
  """Registers per thread of the compute and the memory warpgroups
  (pipeline.REGISTERS or REGISTERS_WIDE): the wide split for D = 128 with a
  causal or window band (with or without segment ids). With 232, ptxas spills
  248 bytes per thread in the D = 128 causal backward (580 with segment ids).
  On an H200 (2026-11-24, bf16, kernel time of forward and backward, two runs
  on two machines) 240 took B1 S16k H16 causal 3.2% and 3.1% faster, B8 S2k
  causal 1.6% and 0.3%, 8 x 2048 packed causal 1.3% and 0.3%, and (second run
  only) GQA 32:8 B2 S8k causal 1.5%; D = 64 causal was 0.6% slower and the
  full band 0.6% slower (first run), so those keep 232. The second run's
  spread on unchanged full-band calls was -0.3% to +0.7%, as large as the
  smaller gains. Windows and full-band calls with segment ids were not
  measured: windows follow causal, full-band calls keep 232. With
  ``shared_block`` (D > 128) the dK/dV kernel's warpgroups each hold a 64 x 256
  fp32 accumulator: the wide split, and the dQ kernel follows it.
  """
  wide = (g.head_dim == 128 and not g.band.is_full) or g.shared_block
  return pipeline.REGISTERS_WIDE if wide else pipeline.REGISTERS


def _segment_parts(g: Geometry, seg, b_idx):
  """``(visible(i), (own ids or spans ref, streamed ids ref, shared memory,
  barriers))`` of a kernel with segment ids, or Nones."""
  if not g.segments:
    return None, None
  (own_ref, streamed_ref, vis_ref), smem, bars = seg
  return (lambda i: tuple(vis_ref[b_idx, j, i] for j in range(4))), (
      own_ref, streamed_ref, *pipeline.segment_buffers(smem, bars))


def _dkv_program(g: Geometry, dtype, single_pass: bool = False):
  """``(scoped, kernel)``: the dK/dV CTA's shared memory and barriers, and
  ``kernel(q, k, v, do, stats, seed, bias, dk, dv, dq, (tile, kv head, batch),
  seg, *scoped)`` for key tile ``tile`` of one (kv head, batch), summing over
  the kv head's query heads; ``seed``: the
  dropout words (or None); ``bias``: the additive tile (or None), read
  transposed; ``dq``: with ``single_pass``, the zeroed fp32 dQ that the CTA
  adds its share into (see :func:`_single_pass_dq`), else None;
  ``seg``: the segment refs (kv ids, q ids, table), shared memory and
  barriers, or None.

  With ``g.shared_block`` (D > 128) the two compute warpgroups share one block of
  keys in two roles instead of owning one each: warpgroup 0 computes P^T and
  dV, warpgroup 1 dP^T, dS^T and dK, each over the whole head dim (one fp32
  accumulator of 64 x 256 fits a warpgroup's registers, two do not). P^T goes
  from one to the other through two fp16 shared-memory buffers, with the
  dropout's drops as its sign and the soft cap's factor folded in, so the
  tensor-core work is the plain kernel's, not computed twice."""
  bq, bk, d, stages = g.block_q, g.block_kv, g.head_dim, g.num_stages
  roles = g.shared_block
  additive = g.bias_dtype is not None
  assert not (roles and additive), "an additive tile needs head dims <= 128"
  assert not (single_pass and (roles or g.bias_grad)), (
      "the single pass needs head dims <= 128 and no dS output")
  regs = pipeline.REGISTERS_WIDE if single_pass else registers(g)

  def kernel(q_ref, k_ref, v_ref, do_ref, st_ref, seed_ref, bias_ref, dk_ref, dv_ref,
             dq_ref, where, seg, smem, bars, free):
    q_free, do_free = free
    tile, kv_h, b_idx = where
    wg = lax.axis_index("wg")
    q_smem, do_smem, st_smem, k_smem, v_smem, *extra = smem
    q_bar, do_bar, st_bar, k_bar, v_bar, *extra_bars = bars
    if single_pass:
      *extra, dq_smem = extra
      *extra_bars, dq_bars = extra_bars
    handover, handover_bars = (extra, extra_bars) if roles else ((), ())
    if additive:
      (bias_smem,), (bias_bar,) = extra, extra_bars
    visible, ids = _segment_parts(g, seg, b_idx)
    ranges, lo_c, hi_c = cta_q_ranges(g, tile, visible)
    # Pipeline steps per query head: the walks of the kv head's query heads
    # (round j: head kv_h * group + j) count one step sequence, so slots and
    # barrier phases run on across them.
    n_steps = hi_c - lo_c
    count = lambda j, s: j * n_steps + s - lo_c  # the CTA's pipeline step
    slot_of = lambda j, s: pipeline.ring_slot(count(j, s), stages)
    query_head = lambda j: kv_h if g.group == 1 else kv_h * g.group + j

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(regs[0], action="increase")
      pick = lambda i: jnp.where(wg == 0, ranges[0][i], ranges[1][i])
      lo, a, bb, hi = (pick(i) for i in range(4))
      k0 = (tile if roles else tile * 2 + wg) * bk
      rows = (b_idx, pl.ds(k0, bk), kv_h)
      # One block each, or the shared block unindexed: a ref indexed by a
      # constant and closed over by pl.run_state fails to lower (jax 0.11).
      my_k, my_v = (k_smem, v_smem) if roles else (k_smem.at[wg], v_smem.at[wg])
      if roles:
        # Warpgroup 0 reads only K, warpgroup 1 only V.
        pl.when(wg == 0)(lambda: plgpu.copy_gmem_to_smem(k_ref.at[rows], my_k,
                                                         k_bar.at[0]))
        pl.when(wg == 1)(lambda: plgpu.copy_gmem_to_smem(v_ref.at[rows], my_v,
                                                         v_bar.at[0]))
      else:
        plgpu.copy_gmem_to_smem(k_ref.at[rows], my_k, k_bar.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], my_v, v_bar.at[wg])
      k_ids = None  # the keys' ids or row spans, with segment ids
      if g.segments:
        kid_ref, _, (kid_smem, qid_smem), (kid_bar, qid_bar) = ids
        k_ids = pipeline.own_ids(kid_ref, kid_smem, kid_bar, b_idx, k0, bk, wg,
                                 plgpu.Layout.WGMMA.reduce(1), g.segment_spans)

      def q_ids(slot, load):
        if not g.segments or g.segment_spans:
          return None
        return pipeline.slot_ids(qid_bar, qid_smem, slot,
                                 plgpu.Layout.WGMMA.reduce(0), load)

      zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32),
                                              plgpu.Layout.WGMMA)
      col = lambda x: lax.broadcast_in_dim(x, (bk, bq), [1])
      inv_keep = dropout.keep_scale(g.dropout_rate)
      if g.dropout_rate:
        # The keys are this warpgroup's own: their hash terms once per CTA.
        key_terms = dropout_col_keys(seed_ref, positions(bk, 0, k0))

      def stat(slot, i):
        return compat.mgpu_load(st_smem.at[slot, i], plgpu.Layout.WGMMA.reduce(0))

      def bias_tile_t(slot, load=True):
        """This warpgroup's keys by the slot's rows of the additive tile."""
        if not additive:
          return None
        return pipeline.slot_tile(bias_smem, bias_bar, slot, wg, load, transposed=True)

      def probs_t(s, slot, masked: bool):
        """P^T of step ``s`` with the band's and the ids' zeros, tanh of the
        soft cap (or None) and the dropout's keep mask (or None)."""
        plgpu.barrier_wait(q_bar.at[slot])

        def st_product(acc_ref):
          plgpu.wgmma(acc_ref, my_k, compat.transpose_ref(q_smem.at[slot], (1, 0)))
          return acc_ref[...]

        st = pl.run_scoped(st_product, plgpu.ACC((bk, bq), jnp.float32))
        plgpu.barrier_wait(st_bar.at[slot])
        pt, tanh = _probs(st, col(stat(slot, 0)), g, bias_tile_t(slot))
        keep = None
        if g.dropout_rate:
          keep = dropout_keep(g, _load_row_keys(st_smem.at[slot],
                                                plgpu.Layout.WGMMA.reduce(0)),
                              key_terms, 1)
        qi = q_ids(slot, masked)
        if masked:
          keys, qrows = _index((bk, bq), 0, k0), _index((bk, bq), 1, s * bq)
          ok = pipeline.allowed(g, qrows, keys, k_ids, qi, (bk, bq), over_kv=False)
          if ok is not None:
            pt = jnp.where(ok, pt, 0.0)
        return pt, tanh, keep

      def step(j, s, carry, masked: bool):
        dk, dv = carry
        slot = slot_of(j, s)
        pt, tanh, keep = probs_t(s, slot, masked)
        # With the single pass's dQ in registers too, delta is read only where
        # dS needs it: loaded beside lse it cost 68 bytes of spills per thread
        # and 9% of the backward's time (H200, 2026-11-29,
        # docs/reports/2026-11-29-h200-single-pass-backward-spills.md).
        delta = None if single_pass else stat(slot, 1)
        plgpu.barrier_wait(do_bar.at[slot])

        def products(refs):
          # dP^T first: dS needs it, while dV (issued second) keeps the tensor
          # cores busy during the dS arithmetic; dO is free once dV is done.
          dpt_ref, dv_ref, dk_ref = refs
          plgpu.wgmma(dpt_ref, my_v, compat.transpose_ref(do_smem.at[slot], (1, 0)))
          # dV takes the kept probabilities; 1 / (1 - rate) scales the fp32 dV
          # accumulator once at the end instead of every element.
          plgpu.wgmma(dv_ref, _dropped(keep, pt).astype(dtype), do_smem.at[slot])
          dpt = plgpu.wgmma_accumulator_load(dpt_ref, wait_n=1)
          dl = stat(slot, 1) if delta is None else delta
          dst = _dscores(pt, _dropped(keep, dpt, inv_keep), col(dl), tanh).astype(dtype)
          plgpu.wgmma(dk_ref, dst, q_smem.at[slot])
          if single_pass:
            dq_part.hand_over(count(j, s), dst)
          plgpu.wgmma_wait(1)
          plgpu.barrier_arrive(do_free.at[slot])
          if single_pass:
            dq_part.previous(count(j, s))

        _, dv, dk = pl.run_state(products)(
            (plgpu.ACC.init(zeros((bk, bq))), plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

      def skip(j, s, carry):
        pipeline.skip_slot(slot_of(j, s), (q_bar, st_bar, do_bar),
                           (q_ids, bias_tile_t), (do_free, q_free))
        if single_pass:
          # The other warpgroup's dQ columns still take this one's (zero) dS^T.
          dq_part.hand_over(count(j, s), zeros((bk, bq)).astype(dtype))
          dq_part.previous(count(j, s))
        return carry

      def walk(body, carry):
        """The band walk of each query head of the kv head in turn,
        ``body(j, s, carry, masked)`` in round ``j``, carrying the sums."""
        def head(j, carry):
          return band_walk(functools.partial(body, j), functools.partial(skip, j),
                           carry, lo_c, (lo, a, bb, hi), hi_c)
        return head(0, carry) if g.group == 1 else lax.fori_loop(0, g.group, head,
                                                                 carry)

      def write(acc, smem_block, out_ref):
        smem_block[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem_block, out_ref.at[b_idx, pl.ds(k0, bk), kv_h])

      if not roles:
        if single_pass:
          dq_part = _single_pass_dq(g, dtype, dq_ref, dq_smem, dq_bars, k_smem, k_bar,
                                    (b_idx, lo_c, n_steps, query_head), zeros)
        plgpu.barrier_wait(k_bar.at[wg])
        plgpu.barrier_wait(v_bar.at[wg])
        if single_pass:
          dq_part.start()
        dk, dv = walk(step, (zeros((bk, d)), zeros((bk, d))))
        if single_pass:
          dq_part.finish(g.group * n_steps)
        write(dk * g.softmax_scale, my_k, dk_ref)
        write(dv * inv_keep if g.dropout_rate else dv, my_v, dv_ref)
        plgpu.wait_smem_to_gmem(0)
        return

      (pt_smem,), (pt_full, pt_free) = handover, handover_bars
      # Both warpgroups walk the same range, with no skip steps: the hand-over
      # of step s in round j is the walk's (j * (hi - lo) + s - lo)-th, in
      # buffer (j * (hi - lo) + s - lo) % 2.
      handed = lambda j, s: j * (hi - lo) + s - lo
      buffer = lambda j, s: lax.rem(handed(j, s), jnp.int32(2))

      def p_step(j, s, dv, masked: bool):
        slot, buf = slot_of(j, s), buffer(j, s)
        pt, tanh, keep = probs_t(s, slot, masked)
        pl.when(handed(j, s) >= 2)(lambda: plgpu.barrier_wait(pt_free.at[buf]))
        pt_smem.at[buf][...] = _handover(pt, tanh, keep).astype(jnp.float16)
        plgpu.barrier_arrive(pt_full.at[buf])
        plgpu.barrier_wait(do_bar.at[slot])

        def products(dv_ref):
          plgpu.wgmma(dv_ref, _dropped(keep, pt).astype(dtype), do_smem.at[slot])

        dv = pl.run_state(products)(plgpu.ACC.init(dv))
        plgpu.barrier_arrive(do_free.at[slot])
        plgpu.barrier_arrive(q_free.at[slot])
        return dv

      def ds_step(j, s, dk, masked: bool):
        del masked  # P^T arrives with its zeros
        slot, buf = slot_of(j, s), buffer(j, s)
        plgpu.barrier_wait(do_bar.at[slot])
        plgpu.barrier_wait(st_bar.at[slot])
        delta = stat(slot, 1)

        def products(refs):
          dpt_ref, dk_ref = refs
          plgpu.wgmma(dpt_ref, my_v, compat.transpose_ref(do_smem.at[slot], (1, 0)))
          dpt = plgpu.wgmma_accumulator_load(dpt_ref, wait_n=0)
          plgpu.barrier_arrive(do_free.at[slot])
          plgpu.barrier_wait(pt_full.at[buf])
          hand = pt_smem.at[buf][...].astype(jnp.float32)
          plgpu.barrier_arrive(pt_free.at[buf])
          dst = _dscores_from_handover(hand, dpt, col(delta), g)
          plgpu.barrier_wait(q_bar.at[slot])
          plgpu.wgmma(dk_ref, dst.astype(dtype), q_smem.at[slot])

        _, dk = pl.run_state(products)(
            (plgpu.ACC.init(zeros((bk, bq))), plgpu.ACC.init(dk)))
        plgpu.barrier_arrive(q_free.at[slot])
        return dk

      @pl.when(wg == 0)
      def _p():
        plgpu.barrier_wait(k_bar.at[0])
        dv = walk(p_step, zeros((bk, d)))
        # K is read by this warpgroup only: dV goes out through its buffer.
        write(dv * inv_keep if g.dropout_rate else dv, my_k, dv_ref)
        plgpu.wait_smem_to_gmem(0)

      @pl.when(wg == 1)
      def _ds():
        plgpu.barrier_wait(v_bar.at[0])
        dk = walk(ds_step, zeros((bk, d)))
        write(dk * g.softmax_scale, my_v, dk_ref)
        plgpu.wait_smem_to_gmem(0)

    def load_do(h, s, slot):
      plgpu.copy_gmem_to_smem(do_ref.at[b_idx, pl.ds(s * bq, bq), h],
                              do_smem.at[slot], do_bar.at[slot])

    def load_q(h, s, slot):
      plgpu.copy_gmem_to_smem(q_ref.at[b_idx, pl.ds(s * bq, bq), h],
                              q_smem.at[slot], q_bar.at[slot])
      plgpu.copy_gmem_to_smem(st_ref.at[b_idx, h, :, pl.ds(s * bq, bq)],
                              st_smem.at[slot], st_bar.at[slot])
      if g.segments and not g.segment_spans:
        _, qid_ref, (_, qid_smem), (_, qid_bar) = ids
        plgpu.copy_gmem_to_smem(qid_ref.at[b_idx, pl.ds(s * bq, bq)],
                                qid_smem.at[slot], qid_bar.at[slot])

    def loads(h):
      """Query head ``h``'s ``(free, load(s, slot))`` pairs: dO is released
      after dV and dP^T, Q, the row stats (and the additive tile) after dK."""
      with_q = functools.partial(load_q, h)
      if additive:
        with_q = pipeline.with_tile(with_q, g, bias_ref, bias_smem, bias_bar, b_idx, h,
                                    lambda w: pl.ds((tile * 2 + w) * bk, bk),
                                    lambda s: pl.ds(s * bq, bq), transposed=True)
      return ((do_free, functools.partial(load_do, h)), (q_free, with_q))

    pl.when(wg == 2)(lambda: pipeline.produce(
        lo_c, hi_c, stages, lambda j: loads(query_head(j)), regs[1],
        rounds=g.group))

  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  own = (bk, d) if roles else (2, bk, d)
  smem = (
      plgpu.SMEM((stages, bq, d), dtype, transforms=tiled),
      plgpu.SMEM((stages, bq, d), dtype, transforms=tiled),
      plgpu.SMEM((stages, _stat_rows(g), bq), jnp.float32),
      plgpu.SMEM(own, dtype, transforms=tiled),
      plgpu.SMEM(own, dtype, transforms=tiled),
  )
  bars = tuple(plgpu.Barrier(num_barriers=n) for n in (stages, stages, stages, 2, 2))
  if roles:
    smem += (plgpu.SMEM((2, bk, bq), jnp.float16, transforms=tiled),)
    bars += (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2))
  if additive:
    tile_smem, tile_bars = pipeline.tile_slots(g.bias_dtype, stages, bk, bq,
                                               transposed=True)
    smem, bars = smem + (tile_smem,), bars + (tile_bars,)
  if single_pass:
    part_smem, part_bars = _single_pass_dq_scoped(g, dtype)
    smem, bars = smem + (part_smem,), bars + (part_bars,)
  return (smem, bars, _free(stages)) + pipeline.segment_scoped(g, bk, bq), kernel


def _split_dq_columns(g: Geometry) -> bool:
  """Whether each warpgroup of the single pass computes half of dQ's columns
  over both warpgroups' keys (D = 128), rather than all columns over its own
  keys (D = 64, where a 32-column half would cut a 128-byte swizzle atom)."""
  return g.head_dim >= 128


def _single_pass_dq_scoped(g: Geometry, dtype):
  """Shared memory and barriers of the single pass's dQ: each warpgroup's dS^T
  by step parity, one fp32 staging tile per warpgroup; dS^T ready and free
  barriers by parity and one barrier for the end of both walks."""
  bq, bk, d = g.block_q, g.block_kv, g.head_dim
  cols = d // 2 if _split_dq_columns(g) else d
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  smem = (plgpu.SMEM((2, 2, bk, bq), dtype, transforms=tiled),
          plgpu.SMEM((2, bq, cols), jnp.float32,
                     transforms=(plgpu.TilingTransform((8, 32)),
                                 plgpu.SwizzleTransform(128))))
  bars = (plgpu.Barrier(num_arrivals=2, num_barriers=2),
          plgpu.Barrier(num_arrivals=2, num_barriers=2),
          plgpu.Barrier(num_arrivals=2))
  return smem, bars


@dataclasses.dataclass(frozen=True)
class _SinglePassDq:
  """A compute warpgroup's share of dQ in the single pass (see
  :func:`_single_pass_dq`)."""
  start: object
  hand_over: object
  previous: object
  finish: object


def _single_pass_dq(g: Geometry, dtype, dq_ref, smem, bars, k_smem, k_bar, where,
                    zeros):
  """The dQ side of the single-pass dK/dV kernel, FlashAttention-3's: for each
  step's block of rows,

    dQ[rows] += dS K   (over the CTA's 2 * block_kv keys),

  added in fp32 into ``dq_ref`` by TMA reduce-add (partials of different CTAs
  land in any order, so dQ's last bits may vary between runs). Each warpgroup
  writes its dS^T to shared memory (``hand_over``); at D = 128 each computes
  half of dQ's columns over both warpgroups' keys, so it reads the other's
  dS^T too.

  The dQ product of step n runs in step n + 1 (``previous``): waiting for the
  other warpgroup's dS^T in the same step would put the warpgroups in lock
  step, both doing their softmax at once while the tensor cores idle (5-20%
  slower than two kernels on an H200, 2026-11-22). One step later the other's
  dS^T is normally long written. Two dS^T buffers by step parity, with
  ``ready`` and ``free`` barriers, carry the hand-over; ``start`` hands over
  zeros for the step before the first, so that every step has a previous one
  and no wgmma sits under a branch, and ``finish(steps)`` adds the last step's
  partial and waits until the other warpgroup no longer reads this one's K.

  ``where``: ``(batch, lo_c, steps per query head, query_head(round))``;
  step ``n`` of the CTA is row block ``lo_c + n % steps`` of query head
  ``query_head(n // steps)``."""
  bq, bk, d = g.block_q, g.block_kv, g.head_dim
  b_idx, lo_c, n_steps, query_head = where
  (ds_smem, stage), (ready, free, done) = smem, bars
  wg = lax.axis_index("wg")
  split = _split_dq_columns(g)
  width = d // 2 if split else d
  cols = pl.ds(wg * width, width) if split else pl.ds(0, d)
  parity = lambda n: lax.rem(n + 2, jnp.int32(2))

  def rows_of(n):
    if g.group == 1:
      return query_head(0), lo_c + n
    per = jnp.maximum(n_steps, 1)
    return query_head(lax.div(n, per)), lo_c + lax.rem(n, per)

  def hand_over(n, dst):
    """dS^T of step ``n`` for both warpgroups' dQ products (``n`` = -1: the
    zeros of :func:`start`)."""
    par = parity(n)
    if split:
      pl.when(n >= 1)(lambda: plgpu.barrier_wait(free.at[par]))
    ds_smem.at[par, wg][...] = dst
    plgpu.commit_smem()
    if split:
      plgpu.barrier_arrive(ready.at[par])

  def previous(n):
    """Step ``n - 1``'s dQ partial from the dS^T in shared memory, issued after
    step ``n``'s dK product, which the wait for this one's result completes;
    added into dQ unless ``n - 1`` is the zero step."""
    prev = parity(n - 1)
    if split:
      plgpu.barrier_wait(ready.at[prev])

    def product(acc_ref):
      for src in ((0, 1) if split else (wg,)):
        plgpu.wgmma(acc_ref, compat.transpose_ref(ds_smem.at[prev, src], (1, 0)),
                    k_smem.at[src, :, cols])
      return acc_ref[...]

    part = pl.run_scoped(product, plgpu.ACC((bq, width), jnp.float32))
    if split:
      plgpu.barrier_arrive(free.at[prev])
    # The previous reduce-add must have read the staging tile.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage.at[wg][...] = part
    plgpu.commit_smem()

    @pl.when(n >= 1)
    def _():
      h, s = rows_of(n - 1)
      plgpu.copy_smem_to_gmem(stage.at[wg], dq_ref.at[b_idx, pl.ds(s * bq, bq), h, cols],
                              reduction_op="add")

  def start():
    hand_over(jnp.int32(-1), zeros((bk, bq)).astype(dtype))
    if split:  # this warpgroup's dQ columns read the other's keys too
      plgpu.barrier_wait(k_bar.at[1 - wg])

  def finish(steps):
    previous(steps)
    if split:
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)

  return _SinglePassDq(start, hand_over, previous, finish)


def _free(stages: int):
  """Two release barriers per slot (one per operand), each awaiting both compute
  warpgroups."""
  return (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2


# Two compute warpgroups and a memory warpgroup per CTA, in every launch.
_THREADS = dict(num_threads=3, thread_name="wg")
_PARAMS = plgpu.CompilerParams(approx_math=True)


def _launch(entry, out_type, grid, grid_names):
  """Mosaic GPU puts a grid's last axis on CUDA's x, which the hardware
  schedules fastest: with tiles last, the CTAs in flight walk one head's
  operands together and keep them in L2 (with batch last they spanned every
  head: an H200 profile of a single-pass backward at B2 S8k read 15.4 GB from
  DRAM on 2026-11-23, and 0.44 GB with tiles last on 2026-11-27)."""
  return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                      compiler_params=_PARAMS, **_THREADS)


def _launch_accumulating(entry, out_type, grid, grid_names):
  """:func:`_launch` whose last output starts as zeros, which the kernel adds
  into: Mosaic-GPU outputs start uninitialised, so the zeros go in as a Ref,
  which ``pl.kernel`` aliases in and out, inside ``pl.run_state`` so that the
  call stays a function of its operands. ``entry`` sees the accumulator last,
  as with :func:`_launch`."""
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, **_THREADS)
  *outs, acc = out_type

  def call(*operands):
    n = len(operands)

    def body(*refs):
      entry(*refs[:n], *refs[n + 1:], refs[n])

    def stateful(refs):
      acc_ref, out_refs = refs
      with compat.without_vma_check():
        res = pl.kernel(body, out_type=tuple(outs), mesh=mesh,
                        compiler_params=_PARAMS)(*operands, acc_ref)
      for ref, x in zip(out_refs, res):
        ref[...] = x

    zeros = lambda t: jnp.zeros(t.shape, t.dtype)
    total, res = pl.run_state(stateful)((zeros(acc), tuple(map(zeros, outs))))
    return (*res, total)
  return call


def _launch_dq(program, g: Geometry, operands):
  """Runs ``program(g) = (entry, out_type, ctas)``, a linear grid of ``ctas``
  CTAs with the dQ kernel's (geometry ``g``), on ``operands``. With
  ``g.ds_batch_sum`` the last output, dS for dbias, is the kernel's sum
  (:func:`_launch_accumulating`); under ``vmap``, where a Ref cannot batch,
  the vmapped kernels write each row's dS (``plgpu.kernel`` batches them) and
  XLA sums it."""
  def make_call(g):
    entry, out_type, ctas = program(g)
    launch = _launch_accumulating if g.ds_batch_sum else _launch
    return launch(entry, out_type, (ctas,), ("t",))

  if not g.ds_batch_sum:
    return make_call(g)(*operands)
  assert g.bias_grad, "the dS batch sum is dbias's"
  call = jax.custom_batching.custom_vmap(make_call(g))

  @call.def_vmap
  def _per_row(axis_size, in_batched, *xs):
    del axis_size
    rows = make_call(dataclasses.replace(g, ds_batch_sum=False))
    *res, ds = jax.vmap(rows, in_axes=tuple(0 if b else None for b in in_batched))(*xs)
    res = (*res, ds.astype(jnp.float32).sum(1, keepdims=True))
    return res, (True,) * len(res)
  return call(*operands)


def _tiles_fastest(i, tiles: int, heads: int):
  """Linear CTA index -> (tile, head, batch), tiles fastest."""
  hb = lax.div(i, jnp.int32(tiles))
  return (lax.rem(i, jnp.int32(tiles)), lax.rem(hb, jnp.int32(heads)),
          lax.div(hb, jnp.int32(heads)))


def _dq_where(g: Geometry, i):
  """dQ CTA ``i`` -> (query tile, head, batch): tiles fastest, so the CTAs in
  flight share one head's K and V in L2; batch-fastest for the kernel's dS
  batch sum, whose adds to one tile then come close in time and meet in L2."""
  if g.ds_batch_sum:
    rest = lax.div(i, jnp.int32(g.batch))
    tile, h = lax.rem(rest, jnp.int32(g.num_q_tiles)), lax.div(
        rest, jnp.int32(g.num_q_tiles))
    b = lax.rem(i, jnp.int32(g.batch))
  else:
    tile, h, b = _tiles_fastest(i, g.num_q_tiles, g.heads_q)
  return _dq_tile(g, tile), h, b


def _run(kernel, scoped, ins, outs, where, seg_refs):
  """Runs one CTA's ``kernel`` in its scoped shared memory and barriers."""
  def body(smem, bars, free, seg_smem=(), seg_bars=()):
    seg = (seg_refs, seg_smem, seg_bars) if seg_refs else None
    kernel(*ins, *outs, where, seg, smem, bars, free)
  pl.run_scoped(body, *scoped, collective_axes="wg")


def _inputs(refs, seed, bias, g: Geometry):
  """``(q, k, v, do, stats, seed or None, bias or None)`` refs (q, K, V and dO
  as the windows at ``g``'s offsets) and the rest."""
  n = 5 + (seed is not None) + (bias is not None)
  q, k, v, do = windows(g, *refs[:3], refs[3])
  rest = list(refs[5:n])
  seed_ref = rest.pop(0) if seed is not None else None
  bias_ref = rest.pop(0) if bias is not None else None
  return (q, k, v, do, refs[4], seed_ref, bias_ref), refs[n:]


def _optional(*xs):
  return tuple(x for x in xs if x is not None)


def ds_dtype(g: Geometry):
  """dS's dtype for dbias: fp32 for the kernel's batch sum
  (``g.ds_batch_sum``); else bf16 where the additive tile is bf16, else fp32.
  The array is the backward's largest write, read again by XLA's batch and
  head sum, so bf16 halves that traffic (forward+backward with a bias
  1.14-1.24x faster on an H200, 2026-11-26); bf16 keeps fp32's range, while
  fp16 would flush the small dS of long rows (P about 1 / S) towards its
  subnormals, so an fp16 tile keeps fp32."""
  if g.ds_batch_sum:
    return jnp.dtype(jnp.float32)
  return jnp.dtype(jnp.bfloat16 if g.bias_dtype == "bfloat16" else jnp.float32)


def _ds_type(g: Geometry):
  """dS for dbias, ``[B, Hq, Sqp, Skp]`` (``[1, ...]``, the batch's sum, with
  ``g.ds_batch_sum``) in :func:`ds_dtype`, with a bias."""
  if not g.bias_grad:
    return ()
  rows = 1 if g.ds_batch_sum else g.batch
  return (jax.ShapeDtypeStruct((rows, g.heads_q, g.seq_q_padded, g.seq_k_padded),
                               ds_dtype(g)),)


def _q_type(g: Geometry, dtype):
  """dQ: ``[B, Sqp, Hq, D]``."""
  return jax.ShapeDtypeStruct((g.batch, g.seq_q_padded, g.heads_q, g.head_dim), dtype)


def _kv_types(g: Geometry, dtype):
  """dK and dV: ``[B, Skp, Hkv, D]`` each."""
  shape = (g.batch, g.seq_k_padded, g.heads_kv, g.head_dim)
  return (jax.ShapeDtypeStruct(shape, dtype),) * 2


def _dkv_grid(g: Geometry):
  """A dK/dV launch's grid and axis names, key tiles last (:func:`_launch`);
  :func:`_dkv_where` reads a CTA's place in it."""
  return (g.batch, g.heads_kv, g.num_kv_tiles), ("b", "h", "kt")


def _dkv_where():
  """The running dK/dV CTA's (key tile, kv head, batch) in :func:`_dkv_grid`."""
  return lax.axis_index("kt"), lax.axis_index("h"), lax.axis_index("b")


def dkv(q, k, v, do, stats, g: Geometry, segments=(), seed=None, bias=None):
  """``q, do [B, Sqp, Hq, D]``, ``k, v [B, Skp, Hkv, D]`` (padded, one dtype; or
  larger arrays holding them at ``g.q_at`` (q and dO), ``g.k_at``, ``g.v_at``),
  ``stats [B, Hq, 2, Sqp]`` fp32: lse in log2 units (+inf on empty and padded
  rows) and delta; ``segments``: kv ids ``[B, Skp]`` (with ``g.segment_spans``
  each key's span of rows ``[B, 2, Skp]``), q ids ``[B, Sqp]`` and the visible q
  blocks per warpgroup key block ``[B, 4, Skp / block_kv]``
  (mosaic.segment_operands with ``over_kv=False``), or (); ``seed`` with
  dropout: the int32 words of
  ``dropout.kernel_seed(..., positions=True)``, the stats then holding each
  row's dropout key in two more rows; ``bias`` with ``g.bias_dtype``: the
  forward's additive tile ``[B|1, H|1, Sqp, Skp]``. Returns ``dk, dv
  [B, Skp, Hkv, D]`` (q's dtype), each kv head's summed over its query heads
  in fp32."""
  scoped, kernel = _dkv_program(g, q.dtype)
  n = len(segments)

  def entry(*refs):
    ins, rest = _inputs(refs, seed, bias, g)
    _run(kernel, scoped, ins, (*rest[n:], None), _dkv_where(), rest[:n])

  return _launch(entry, _kv_types(g, q.dtype), *_dkv_grid(g))(
      q, k, v, do, stats, *_optional(seed, bias), *segments)


def _dq_program(g: Geometry, dtype):
  """``(scoped, kernel)`` of the dQ CTA, ``kernel(q, k, v, do, stats, seed, bias,
  dq, ds, (tile, head, batch), seg, *scoped)`` for query tile ``tile``; ``bias``
  the additive tile and ``ds`` dbias's output (each or None); ``seg`` as in
  :func:`_dkv_program` with q ids first.

  With ``g.shared_block`` (D > 128) the two compute warpgroups share one block of
  rows in two roles, as in the dK/dV kernel: warpgroup 0 computes P (handing it
  over as there) and the first half of dQ's columns, warpgroup 1 dP, dS (handed
  back through shared memory) and the second half. Blocks are held as two
  column halves (:func:`_copy_halves`), the operands of the halves' products."""
  bq, bk, stages = g.block_q, g.block_kv, g.num_stages
  roles = g.shared_block
  additive = g.bias_dtype is not None
  assert not (roles and additive), "an additive tile needs head dims <= 128"

  def kernel(q_ref, k_ref, v_ref, do_ref, st_ref, seed_ref, bias_ref, dq_ref, ds_ref,
             where, seg, smem, bars, free):
    tile, h, b_idx = where
    wg = lax.axis_index("wg")
    q_smem, do_smem, st_smem, k_smem, v_smem, *extra = smem
    q_bar, do_bar, st_bar, k_bar, v_bar, *extra_bars = bars
    handover, handover_bars = (extra, extra_bars) if roles else ((), ())
    if additive:
      bias_smem, *ds_smem = extra
      (bias_bar,) = extra_bars
    k_free, v_free = free
    visible, ids = _segment_parts(g, seg, b_idx)
    ranges, lo_c, hi_c = cta_block_ranges(g, tile, visible)
    slot_of = lambda s: pipeline.ring_slot(s - lo_c, stages)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(registers(g)[0], action="increase")
      pick = lambda i: jnp.where(wg == 0, ranges[0][i], ranges[1][i])
      lo, a, bb, hi = (pick(i) for i in range(4))
      r0 = (tile if roles else tile * 2 + wg) * bq
      rows = (b_idx, pl.ds(r0, bq), h)
      my_st = st_smem.at[wg]
      if roles:
        # Warpgroup 0 reads only Q, warpgroup 1 only dO, each both halves.
        for i in range(2):
          pl.when(wg == 0)(functools.partial(
              _copy_half, g, q_ref, rows, i, q_smem.at[i], q_bar.at[i]))
          pl.when(wg == 1)(functools.partial(
              _copy_half, g, do_ref, rows, i, do_smem.at[i], do_bar.at[i]))
      else:
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[wg], do_bar.at[wg])
      plgpu.copy_gmem_to_smem(st_ref.at[b_idx, h, :, pl.ds(r0, bq)], my_st,
                              st_bar.at[wg])
      q_ids = None  # the rows' ids or key spans, with segment ids
      if g.segments:
        qid_ref, _, (qid_smem, kid_smem), (qid_bar, kid_bar) = ids
        q_ids = pipeline.own_ids(qid_ref, qid_smem, qid_bar, b_idx, r0, bq, wg,
                                 plgpu.Layout.WGMMA.reduce(1), g.segment_spans)
      plgpu.barrier_wait(st_bar.at[wg])

      def kv_ids(slot, load):
        if not g.segments or g.segment_spans:
          return None
        return pipeline.slot_ids(kid_bar, kid_smem, slot,
                                 plgpu.Layout.WGMMA.reduce(0), load)
      lse2 = compat.mgpu_load(my_st.at[0], plgpu.Layout.WGMMA.reduce(1))
      delta = compat.mgpu_load(my_st.at[1], plgpu.Layout.WGMMA.reduce(1))
      row = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])
      inv_keep = dropout.keep_scale(g.dropout_rate)
      if g.dropout_rate:
        row_keys = _load_row_keys(my_st, plgpu.Layout.WGMMA.reduce(1))
      zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32),
                                              plgpu.Layout.WGMMA)

      def bias_tile(slot, load=True):
        """This warpgroup's rows of the slot's additive tile."""
        if not additive:
          return None
        return pipeline.slot_tile(bias_smem, bias_bar, slot, wg, load)

      def store_ds(s, ds):
        """dS of step ``s`` (the logits' gradient) to its dbias tile, staged in
        shared memory (added to the batch's sum with ``g.ds_batch_sum``); the
        previous step's copy has read the stage by then."""
        if ds_ref is None:
          return
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        ds_smem[0].at[wg][...] = ds.astype(ds_smem[0].dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            ds_smem[0].at[wg],
            ds_ref.at[0 if g.ds_batch_sum else b_idx, h, pl.ds(r0, bq),
                      pl.ds(s * bk, bk)],
            reduction_op="add" if g.ds_batch_sum else None)

      def zero_ds(lo, hi):
        """Zeros to the dbias tiles of the blocks outside ``[lo, hi)``, which
        this warpgroup's walk does not write (a batch sum starts zeroed; with
        ``g.ds_reached_only`` the caller zeroes them)."""
        if ds_ref is None or g.ds_batch_sum or g.ds_reached_only:
          return
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        ds_smem[0].at[wg][...] = zeros((bq, bk)).astype(ds_smem[0].dtype)
        plgpu.commit_smem()

        def zero(j):
          plgpu.copy_smem_to_gmem(ds_smem[0].at[wg],
                                  ds_ref.at[b_idx, h, pl.ds(r0, bq), pl.ds(j * bk, bk)])
        pl.loop(0, lo)(zero)
        pl.loop(hi, g.seq_k_padded // bk)(zero)

      def keep_of(s):
        if not g.dropout_rate:
          return None
        return dropout_keep(g, row_keys,
                            dropout_col_keys(seed_ref, positions(bk, 1, s * bk)), 0)

      def masked_probs(s, slot, scores, masked: bool, bias=None):
        """P from the scores of step ``s`` and the additive tile (or None), with
        the band's, the padding's and the ids' zeros, and tanh of the soft cap
        (or None)."""
        k_ids = kv_ids(slot, masked)
        p, tanh = _probs(scores, row(lse2), g, bias)
        if masked:
          qrows, keys = _index((bq, bk), 0, r0), _index((bq, bk), 1, s * bk)
          ok = pipeline.allowed(g, qrows, keys, q_ids, k_ids, (bq, bk))
          p = jnp.where(ok, p, 0.0)
        return p, tanh

      def step(s, acc, masked: bool):
        slot = slot_of(s)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        keep = keep_of(s)
        bias = bias_tile(slot)

        def products(refs):
          # P is computed while dP (issued second) is still on the tensor cores.
          s_ref, dp_ref, acc_ref = refs
          plgpu.wgmma(s_ref, q_smem.at[wg], compat.transpose_ref(k_smem.at[slot], (1, 0)))
          plgpu.wgmma(dp_ref, do_smem.at[wg], compat.transpose_ref(v_smem.at[slot], (1, 0)))
          p, tanh = masked_probs(s, slot, plgpu.wgmma_accumulator_load(s_ref, wait_n=1),
                                 masked, bias)
          dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)
          plgpu.barrier_arrive(v_free.at[slot])
          ds = _dscores(p, _dropped(keep, dp, inv_keep), row(delta), tanh)
          plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])
          store_ds(s, ds)

        _, _, acc = pl.run_state(products)(
            (plgpu.ACC.init(zeros((bq, bk))), plgpu.ACC.init(zeros((bq, bk))),
             plgpu.ACC.init(acc)))
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

      def skip(s, carry):
        pipeline.skip_slot(slot_of(s), (k_bar, v_bar), (kv_ids, bias_tile),
                           (v_free, k_free))
        return carry

      walk = lambda body, carry: band_walk(body, skip, carry, lo_c, (lo, a, bb, hi),
                                           hi_c)

      def write(acc, smem_block, out_rows):
        smem_block[...] = (acc * g.softmax_scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem_block, dq_ref.at[out_rows])
        plgpu.wait_smem_to_gmem(0)

      if not roles:
        plgpu.barrier_wait(q_bar.at[wg])
        plgpu.barrier_wait(do_bar.at[wg])
        acc = walk(step, zeros((bq, g.head_dim)))
        zero_ds(lo, hi)
        write(acc, q_smem.at[wg], rows)
        return

      (p_smem, ds_back), (p_full, p_free, ds_full, ds_free) = handover, handover_bars
      half = g.head_dim // 2
      # Both warpgroups walk the same range, with no skip steps: the P buffer
      # of step s is (s - lo) % 2; dS has one buffer.
      buffer = lambda s: lax.rem(s - lo, jnp.int32(2))

      def p_step(s, acc, masked: bool):
        slot, buf = slot_of(s), buffer(s)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])  # V is warpgroup 1's
        scores = _product_over_halves(q_smem, k_smem.at[slot], (bq, bk))
        p, tanh = masked_probs(s, slot, scores, masked)
        pl.when(s - lo >= 2)(lambda: plgpu.barrier_wait(p_free.at[buf]))
        p_smem.at[buf][...] = _handover(p, tanh, keep_of(s)).astype(jnp.float16)
        plgpu.barrier_arrive(p_full.at[buf])
        plgpu.barrier_wait(ds_full.at[0])

        def dq_product(acc_ref):
          plgpu.wgmma(acc_ref, ds_back, k_smem.at[slot, 0])

        acc = pl.run_state(dq_product)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(ds_free.at[0])
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

      def ds_step(s, acc, masked: bool):
        del masked  # P arrives with its zeros
        slot, buf = slot_of(s), buffer(s)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        dp = _product_over_halves(do_smem, v_smem.at[slot], (bq, bk))
        plgpu.barrier_arrive(v_free.at[slot])
        plgpu.barrier_wait(p_full.at[buf])
        hand = p_smem.at[buf][...].astype(jnp.float32)
        plgpu.barrier_arrive(p_free.at[buf])
        ds = _dscores_from_handover(hand, dp, row(delta), g).astype(dtype)
        pl.when(s - lo >= 1)(lambda: plgpu.barrier_wait(ds_free.at[0]))
        ds_back[...] = ds
        # Warpgroup 0's wgmma reads dS through the async proxy.
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_full.at[0])

        def dq_product(acc_ref):
          plgpu.wgmma(acc_ref, ds, k_smem.at[slot, 1])

        acc = pl.run_state(dq_product)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(k_free.at[slot])
        return acc

      @pl.when(wg == 0)
      def _p():
        plgpu.barrier_wait(q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[1])
        # Q is read by this warpgroup only: its dQ half goes out through Q's.
        write(walk(p_step, zeros((bq, half))), q_smem.at[0],
              rows + (pl.ds(0, half),))

      @pl.when(wg == 1)
      def _ds():
        plgpu.barrier_wait(do_bar.at[0])
        plgpu.barrier_wait(do_bar.at[1])
        write(walk(ds_step, zeros((bq, half))), do_smem.at[1],
              rows + (pl.ds(half, half),))

    load_k, load_v = pipeline.kv_loader(
        g, (k_ref, v_ref), (k_smem, v_smem), (k_bar, v_bar), b_idx,
        lax.div(h, jnp.int32(g.group)),
        copy=functools.partial(_copy_halves, g) if roles else pipeline.copy_block)
    if g.segments and not g.segment_spans:
      _, kid_ref, (_, kid_smem), (_, kid_bar) = ids
      load_k = pipeline.with_ids(load_k, g, kid_ref, kid_smem, kid_bar, b_idx)
    if additive:
      load_k = pipeline.with_tile(load_k, g, bias_ref, bias_smem, bias_bar, b_idx, h,
                                  lambda w: pl.ds((tile * 2 + w) * bq, bq),
                                  lambda s: pl.ds(s * bk, bk))
    # V is released after S and dP, K (and the additive tile) after the dQ
    # product.
    pl.when(wg == 2)(lambda: pipeline.produce(
        lo_c, hi_c, stages, lambda _: ((v_free, load_v), (k_free, load_k)),
        registers(g)[1]))

  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  # Two blocks of rows, or the two column halves of one; two-part slots with
  # roles (two copies, so two arrivals per barrier).
  cols = g.head_dim // 2 if roles else g.head_dim
  slot = (stages, 2, bk, cols) if roles else (stages, bk, cols)
  smem = (
      plgpu.SMEM((2, bq, cols), dtype, transforms=tiled),
      plgpu.SMEM((2, bq, cols), dtype, transforms=tiled),
      plgpu.SMEM((2, _stat_rows(g), bq), jnp.float32),
      plgpu.SMEM(slot, dtype, transforms=tiled),
      plgpu.SMEM(slot, dtype, transforms=tiled),
  )
  parts = 2 if roles else 1
  bars = (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
          plgpu.Barrier(num_barriers=2),
          plgpu.Barrier(num_arrivals=parts, num_barriers=stages),
          plgpu.Barrier(num_arrivals=parts, num_barriers=stages))
  if roles:
    smem += (plgpu.SMEM((2, bq, bk), jnp.float16, transforms=tiled),
             plgpu.SMEM((bq, bk), dtype, transforms=tiled))
    bars += tuple(plgpu.Barrier(num_barriers=n) for n in (2, 2, 1, 1))
  if additive:
    tile_smem, tile_bars = pipeline.tile_slots(g.bias_dtype, stages, bq, bk)
    smem, bars = smem + (tile_smem,), bars + (tile_bars,)
    if g.bias_grad:  # one dS stage per warpgroup
      smem += (plgpu.SMEM((2, bq, bk), ds_dtype(g),
                          transforms=additive_tiling(ds_dtype(g), bk)),)
  return (smem, bars, _free(stages)) + pipeline.segment_scoped(g, bq, bk), kernel


def _dq_tile(g: Geometry, index):
  """Reverse tile order: the longest causal rows start first."""
  return (g.num_q_tiles - 1) - index


def dq(q, k, v, do, stats, g: Geometry, segments=(), seed=None, bias=None):
  """Same operands as :func:`dkv` with the forward's padding (Sq to ``2 *
  block_q``, Sk to ``block_kv``); ``segments`` as mosaic.segment_operands gives
  them (the rows' ids or key spans first, the visible kv blocks per warpgroup
  row block); ``bias``: the additive tile ``[B|1, H|1, Sqp, Skp]``.
  Returns ``dq [B, Sqp, Hq, D]`` (q's dtype) and, with ``g.bias_grad``, dS
  (:func:`_ds_type`; else None)."""
  n = len(segments)

  def program(g):
    scoped, kernel = _dq_program(g, q.dtype)

    def entry(*refs):
      ins, rest = _inputs(refs, seed, bias, g)
      outs = rest[n:]
      _run(kernel, scoped, ins, (outs[0], outs[1] if g.bias_grad else None),
           _dq_where(g, lax.axis_index("t")), rest[:n])

    return (entry, (_q_type(g, q.dtype),) + _ds_type(g),
            g.batch * g.heads_q * g.num_q_tiles)

  res = _launch_dq(program, g, (q, k, v, do, stats, *_optional(seed, bias),
                                *segments))
  return res[0], (res[1] if g.bias_grad else None)


def dq_dkv(q, k, v, do, stats, g_dq: Geometry, g_dkv: Geometry, seg_dq=(),
           seg_dkv=(), seed=None, bias=None):
  """:func:`dq` and :func:`dkv` in one launch: every dK/dV CTA first (tiles
  fastest, so CTAs in flight share one head's Q and dO in L2), then every dQ CTA.
  The two grids' tails become one, filled by the shorter dQ CTAs. ``bias``: the
  additive tile, which both kernels read. Returns ``(dq, dk, dv, ds or
  None)``."""
  assert g_dq.batch == g_dkv.batch and g_dq.heads_q == g_dkv.heads_q
  # Both kernels read their operands through g_dq's windows (_inputs).
  same = lambda g: (g.q_at, g.k_at, g.v_at, g.seq_q_padded, g.seq_k_padded)
  assert same(g_dq) == same(g_dkv), (same(g_dq), same(g_dkv))
  dkv_scoped, dkv_kernel = _dkv_program(g_dkv, q.dtype)
  n_kv, n_q, heads = g_dkv.num_kv_tiles, g_dq.num_q_tiles, g_dq.heads_q
  first_dq = n_kv * g_dkv.heads_kv * g_dq.batch
  n1, n2 = len(seg_dq), len(seg_dkv)

  def program(g_dq):
    dq_scoped, dq_kernel = _dq_program(g_dq, q.dtype)

    def entry(*refs):
      t = lax.axis_index("t")
      ins, rest = _inputs(refs, seed, bias, g_dq)
      dq_seg, dkv_seg = rest[:n1], rest[n1:n1 + n2]
      dq_ref, dk_ref, dv_ref, *ds_ref = rest[n1 + n2:]

      @pl.when(t < first_dq)
      def _():
        _run(dkv_kernel, dkv_scoped, ins, (dk_ref, dv_ref, None),
             _tiles_fastest(t, n_kv, g_dkv.heads_kv), dkv_seg)

      @pl.when(t >= first_dq)
      def _():
        _run(dq_kernel, dq_scoped, ins, (dq_ref, ds_ref[0] if ds_ref else None),
             _dq_where(g_dq, t - first_dq), dq_seg)

    out_type = (_q_type(g_dq, q.dtype),) + _kv_types(g_dkv, q.dtype) + _ds_type(g_dq)
    return entry, out_type, first_dq + n_q * heads * g_dq.batch

  res = _launch_dq(program, g_dq, (q, k, v, do, stats,
                                   *_optional(seed, bias), *seg_dq, *seg_dkv))
  return tuple(res[:3]) + (res[3] if g_dq.bias_grad else None,)


def single_pass(q, k, v, do, stats, g_dq: Geometry, g_dkv: Geometry, seg_dq=(),
                seg_dkv=(), seed=None, bias=None):
  """:func:`dq_dkv`'s gradients from the dK/dV kernel alone: its CTAs also add
  each step's dQ partial into a zeroed fp32 dQ (:func:`_single_pass_dq`), five
  block products per step instead of the two kernels' seven. dQ's last bits may
  vary between runs. Head dims up to 128, no dS for dbias (``g_dq.bias_grad``
  off); ``bias`` may be a mask's additive tile. Under ``vmap`` the two kernels
  run: the accumulator is a mutable ref, which cannot batch. Returns ``(dq, dk,
  dv, None)``, dq in q's dtype."""
  assert not g_dq.bias_grad and not g_dkv.shared_block
  scoped, kernel = _dkv_program(g_dkv, q.dtype, single_pass=True)
  n = len(seg_dkv)
  dtype = q.dtype

  def entry(*refs):
    # _launch_accumulating hands the dQ accumulator over last.
    ins, rest = _inputs(refs, seed, bias, g_dkv)
    _run(kernel, scoped, ins, tuple(rest[n:]), _dkv_where(), rest[:n])

  call = _launch_accumulating(
      entry, _kv_types(g_dkv, dtype) + (_q_type(g_dkv, jnp.float32),),
      *_dkv_grid(g_dkv))

  def split(xs):
    """``(q, k, v, do, stats), seed, bias, seg_dq, seg_dkv`` of ``run``'s operands."""
    xs = list(xs)
    seed_x = xs.pop(5) if seed is not None else None
    bias_x = xs.pop(5) if bias is not None else None
    n_dq = len(seg_dq)
    return xs[:5], seed_x, bias_x, xs[5:5 + n_dq], xs[5 + n_dq:]

  @jax.custom_batching.custom_vmap
  def run(*operands):
    base, seed_x, bias_x, _, seg = split(operands)
    dk, dv, dq_sum = call(*base, *_optional(seed_x, bias_x), *seg)
    return (dq_sum * g_dkv.softmax_scale).astype(dtype), dk, dv

  @run.def_vmap
  def _two_kernels(axis_size, in_batched, *operands):
    del axis_size

    def kernels(*xs):
      base, seed_x, bias_x, sq, skv = split(xs)
      return dq_dkv(*base, g_dq, g_dkv, sq, skv, seed_x, bias_x)[:3]

    axes = tuple(0 if b else None for b in in_batched)
    return jax.vmap(kernels, in_axes=axes)(*operands), (True,) * 3

  return run(q, k, v, do, stats, *_optional(seed, bias), *seg_dq, *seg_dkv) + (None,)
