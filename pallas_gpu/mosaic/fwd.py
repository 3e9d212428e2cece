"""Mosaic-GPU forward kernel for Hopper (FlashAttention-3 structure).

A q tile is ``2 * block_q`` query rows of one (batch, q head). Each CTA runs three
warpgroups: a memory warpgroup streams K/V blocks into a ring of shared-memory
slots with TMA, and two compute warpgroups each own ``block_q`` rows of the tile,
run QK^T and PV on the tensor cores (wgmma) and keep the online softmax in
registers. A two-party barrier offsets the compute warpgroups by half a step, so
one runs its softmax while the other's matmuls occupy the tensor cores (ping-pong).

Persistent launch (``Geometry.persistent_ctas``): one CTA per SM walks q tiles
``cta, cta + n, ...``, or with ``Geometry.balanced`` its row of
blocks.balanced_order (a causal or window band: computed on the host; segment
ids: on the device), reading each tile's table entry and walk a tile ahead
(blocks.walks_ahead). The ring keeps counting steps across tiles, so the memory
warpgroup loads the next tile's K/V while the compute warpgroups finish this one;
each compute warpgroup loads its next Q as soon as its last QK^T product is done
and stores its output through a separate staging buffer without waiting for the
store. Short sequences (few kv steps per tile) lose most to per-tile start-up
otherwise. Without it, one CTA per tile (the hardware balances uneven causal
tiles).

Split tail (``MosaicForward.split_tail``, full band, persistent): the last,
partial round of q tiles runs as key-range parts (blocks.unit_walk); a
part stores its normalised output as a high and a low half in the input dtype
and its lse in log2 units, and tail_merge.combine merges each tile's parts into
the output and lse in place.

Band blocks: the CTA walks the kv blocks that either warpgroup reaches. Each
warpgroup splits that walk into skip / masked / plain / masked / skip phases
(blocks.band_walk); skip steps still wait for the slot's data and release it, so
every thread's barrier phases and the ping-pong stay in step.

Segment ids (``Geometry.segments``): each warpgroup's walk is cut to the kv blocks
whose ids can meet its rows' (a ``[B, 4, Sqp / block_q]`` table read as scalars,
common/segments.py), so a packed call visits the blocks of its documents only;
blocks that hold the rows' own single id are masked by the band alone. The
warpgroup's q ids come with Q, each slot's kv ids with K (their own barriers),
and are read into registers before K is released. Comparing ids on masked
steps cost 10-12% of the forward at 16k tokens on an H200, mostly in registers
(docs/reports/2026-11-27-h200-segment-compare.md). With contiguous segments
(``Geometry.segment_spans``: each id's keys form one run, as packed documents'
do) each row's key span comes with Q instead (common/segments.spans), no kv ids
stream, and a masked step compares key positions with two per-row bounds that
hold the band and Sk too, as the band alone did; the table then comes from the
spans (segments.span_blocks). The caller promises the runs
(``contiguous_segments``): choosing the form from the ids on the device cost
more than it saved on an H200 (2026-11-27: a ``lax.cond`` between two kernels
about 14 us per call, both forms in one kernel a forward 0.81-0.96x;
docs/reports/2026-11-27-h200-segment-spans.md).

Bias and dense mask (``Geometry.bias_dtype``): one additive tile ``[B|1, H|1, Sqp,
Skp]`` (the bias plus 0 / -inf for the mask, built in XLA; a mask alone in
float8_e5m2), copied per step with K, ``block_q`` rows by ``block_kv`` keys per
warpgroup, each on its own barrier; each warpgroup reads its tile into
registers while its QK^T product runs and adds it to the scaled logits, so every
step guards rows that are still all -inf.

Dropout (``Geometry.dropout_rate``): each warpgroup hashes its rows' keys
(common/dropout.row_key) once per tile and each step's key terms once per
step, so an element costs only dropout.mix_element and the compare; then it
zeroes the dropped probabilities before PV; the row sum l keeps them all, and
1 / (1 - rate) scales the output.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ...common import compat, dropout
from ...common.blocking import LOG2E
from .. import tail_merge
from . import pipeline
from .blocks import (Geometry, balanced_order, band_walk, dropout_col_keys,
                     dropout_keep, dropout_row_keys, positions, tail_plan,
                     tile_coords, tiles_of_cta, unit_tile, walks_ahead, windows)


# Hopper gives a CTA 227 KiB (232,448 bytes) of shared memory. Mosaic-GPU
# aligns each buffer to 1 KiB; the barriers take about 120 bytes.
SMEM_BYTES = 227 * 1024
_BARRIERS = 1024

# Every row max and sum here reduces within a warp (the WGMMA layout keeps a
# row's columns in one warp's lanes), so the kernel needs none of the 2 KiB
# Mosaic-GPU reserves by default for cross-warp reductions (Mosaic raises at
# lowering if one ever does). Those 2 KiB kept out a 16-bit bias tile beside
# 128-key blocks, and a float8 mask tile beside 128-key blocks and the output's
# own staging buffer: 232,568 bytes against 232,448.
_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def smem_bytes(g: Geometry, separate_o: bool) -> int:
  """The forward's shared memory: Q (two warpgroup blocks), the K/V ring, the
  lse staging, the additive tile's ring, the segment buffers and, with
  ``separate_o``, the output's own staging buffer."""
  item = 2  # bf16/fp16
  bq, bk, d, stages = g.block_q, g.block_kv, g.head_dim, g.num_stages
  q = 2 * bq * d * item
  bufs = [q, stages * bk * d * item, stages * bk * d * item, 2 * bq * 4]
  if separate_o:
    bufs.append(q)
  if g.bias_dtype is not None:
    bufs.append(stages * 2 * bq * bk * jnp.dtype(g.bias_dtype).itemsize)
  if g.segments:
    bufs += [2 * 2 * bq * 4] if g.segment_spans else [2 * bq * 4, stages * bk * 4]
  return sum(-(-b // 1024) * 1024 for b in bufs) + _BARRIERS


def separate_out_smem(g: Geometry) -> bool:
  """Whether the output gets a staging buffer of its own; if not, it is staged
  in Q's buffer and the next Q load waits for the store. At D = 128 beside a
  float8 mask tile and 128-key blocks the buffer fits, but the forward was no
  faster with it (H200, 2026-11-28, B8 S2k and B2 S8k, causal or not:
  0.749-0.801x of the call without the mask against 0.737-0.809x staged in
  Q), so there it is not taken."""
  if g.bias_dtype is not None and g.block_kv > 64 and g.head_dim > 64:
    return False
  return smem_bytes(g, True) <= SMEM_BYTES


def forward(q, k, v, g: Geometry, segments=(), bias=None, seed=None):
  """``q [B, Sqp, Hq, D]``, ``k/v [B, Skp, Hkv, D]`` (padded; or larger arrays
  holding them at ``g.q_at``, ``g.k_at``, ``g.v_at``) ->
  ``out [B, Sqp, Hq, D]`` (q's dtype) and ``lse [B, Hq, Sqp]`` (fp32, natural log).
  ``segments`` (with ``g.segments``, mosaic.segment_operands): q ids ``[B, Sqp]``
  (with ``g.segment_spans`` each query's key span ``[B, 2, Sqp]``), kv ids ``[B,
  Skp]`` (int32) and the visible kv blocks ``[B, 4, Sqp / block_q]`` per
  warpgroup rows. ``bias`` (with ``g.bias_dtype``): the additive tile operand
  ``[B|1, H|1, Sqp, Skp]``. ``seed`` (with ``g.dropout_rate``): the
  int32 words of ``dropout.kernel_seed(..., positions=True)``."""
  bq, bk, d, stages = g.block_q, g.block_kv, g.head_dim, g.num_stages
  dtype = q.dtype
  scale2 = g.softmax_scale * LOG2E  # logits in log2 units: exp2 on the SFU
  ctas = g.num_ctas
  separate_o = separate_out_smem(g)
  tail = tail_plan(g)

  def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, parts, seg, add, seed_ref, order_ref,
             smem, bars, free, sched):
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    if g.balanced:  # blocks.balanced_order's row: the count, then the tiles
      n_local = order_ref[cta, 0]
      unit = lambda it: order_ref[cta, 1 + it]
    else:
      n_local = tiles_of_cta(g, cta)  # at least one: ctas <= tiles
      unit = lambda it: cta + it * ctas
    q_smem, k_smem, v_smem, lse_smem, *o_smem = smem
    k_bar, v_bar, q_bar = bars
    k_free, v_free = free
    if g.segments:
      (qid_ref, kid_ref, vis_ref), (qid_smem, kid_smem), (qid_bar, kid_bar) = seg
      visible = lambda b, i: tuple(vis_ref[b, j, i] for j in range(4))
    else:
      visible = None
    if add is not None:
      bias_ref, bias_smem, bias_bar = add

    def rendezvous():
      plgpu.barrier_arrive(sched)
      plgpu.barrier_wait(sched)

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(pipeline.REGISTERS[0], action="increase")
      my_q = q_smem.at[wg]
      my_o = o_smem[0].at[wg] if separate_o else my_q

      def rows_of(t):
        b_idx, h, tile = tile_coords(g, t)
        return b_idx, h, tile, tile * (2 * bq) + wg * bq

      def load_q(u):
        b_idx, h, _, r0 = rows_of(unit_tile(g, u))
        plgpu.copy_gmem_to_smem(q_ref.at[b_idx, pl.ds(r0, bq), h], my_q, q_bar.at[wg])
        if g.segments:  # the rows' ids, or their key spans' starts and ends
          plgpu.copy_gmem_to_smem(
              pipeline.own_window(qid_ref, b_idx, r0, bq, g.segment_spans),
              qid_smem.at[wg], qid_bar.at[wg])

      first, take = walks_ahead(g, n_local, unit, visible)
      load_q(unit(0))

      def tile_body(it, carry):
        base, ahead = carry
        (t, whole, part, ranges, lo_c, hi_c), ahead = take(it, ahead)
        b_idx, h, tile, r0 = rows_of(t)
        pick = lambda i: jnp.where(wg == 0, ranges[0][i], ranges[1][i])
        lo, a, bb, hi = (pick(i) for i in range(4))
        slot_of = lambda s: pipeline.ring_slot(base + s - lo_c, stages)
        plgpu.barrier_wait(q_bar.at[wg])
        own = None  # the rows' ids or key spans, with segment ids
        if g.segments:
          own = pipeline.own_rows(qid_bar, qid_smem, wg, plgpu.Layout.WGMMA.reduce(1),
                                  g.segment_spans)
        if g.dropout_rate:
          # The row key (dropout.row_key) depends on the row alone: once per tile.
          row_keys = dropout_row_keys(seed_ref, b_idx, h, positions(bq, 0, r0))

        def dropped(p, s):
          """p with step ``s``'s dropped probabilities zeroed (1 / (1 - rate)
          scales the output once, not every element)."""
          if not g.dropout_rate:
            return p
          col_keys = dropout_col_keys(seed_ref, positions(bk, 1, s * bk))
          return jnp.where(dropout_keep(g, row_keys, col_keys, 0), p, 0.0)

        def bias_tile(slot, load=True, raw=False):
          """This warpgroup's rows of the slot's additive tile (as stored with
          ``raw``, else fp32 logits units of the input), waited for by every
          step; None without one."""
          if g.bias_dtype is None:
            return None
          return pipeline.slot_tile(bias_smem, bias_bar, slot, wg, load, raw)

        def kv_ids(slot, load):
          """The slot's kv ids, read before K's slot is released."""
          if not g.segments or g.segment_spans:
            return None
          return pipeline.slot_ids(kid_bar, kid_smem, slot,
                                   plgpu.Layout.WGMMA.reduce(0), load)

        m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32),
                                plgpu.Layout.WGMMA)

        pl.when(lo_c < hi_c)(lambda: plgpu.barrier_wait(k_bar.at[slot_of(lo_c)]))
        pl.when(wg == 1)(rendezvous)

        def wait_next_k(s):
          # Invariant: when step s starts, K of step s has been waited for. The
          # wait for s + 1 is issued while step s's PV product runs.
          nxt = s + 1
          pl.when(nxt < hi_c)(lambda: plgpu.barrier_wait(k_bar.at[slot_of(nxt)]))

        def step(s, carry, masked: bool):
          acc, m, l = carry
          slot = slot_of(s)

          def qk_product(acc_ref):
            plgpu.wgmma(acc_ref, my_q, compat.transpose_ref(k_smem.at[slot], (1, 0)))
            # The additive tile is read while QK^T runs: read after it, a
            # 128-key mask tile made causal forwards 1.24-1.29x slower (H200,
            # 2026-11-28, docs/reports/2026-11-28-h200-mask-tile.md).
            raw = bias_tile(slot, raw=True)
            rendezvous()
            return acc_ref[...], raw

          s2, raw = pl.run_scoped(qk_product, plgpu.ACC((bq, bk), jnp.float32))
          k_ids = kv_ids(slot, masked)
          tile_bias = None if raw is None else pipeline.tile_logits(raw)
          plgpu.barrier_arrive(k_free.at[slot])
          # Logits are scale * s + bias, then soft-capped (the contract's order).
          if g.soft_cap is not None:
            cap = g.soft_cap
            if tile_bias is None:
              x = s2 * (g.softmax_scale / cap)
            else:
              x = (s2 * g.softmax_scale + tile_bias) * (1.0 / cap)
            s2, mult = jnp.tanh(x) * (cap * LOG2E), 1.0
          elif tile_bias is not None:
            # Natural-log units, one FMA; log2(e) rides in the exp2 argument.
            s2, mult = s2 * g.softmax_scale + tile_bias, LOG2E
          else:
            # The scale rides in the exp2 argument (one FMA per element); the row
            # max commutes with a positive scale.
            mult = scale2
          if masked:
            rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0,
                                          layout=plgpu.Layout.WGMMA) + r0
            cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1,
                                          layout=plgpu.Layout.WGMMA) + s * bk
            ok = pipeline.allowed(g, rows, cols, own, k_ids, s2.shape)
            s2 = jnp.where(ok, s2, -jnp.inf)
          m_new = jnp.maximum(m, s2.max(axis=1) * mult)
          # Rows with nothing allowed yet keep m = -inf: shift by 0, not -inf.
          guard = masked or g.bias_dtype is not None
          shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard else m_new
          alpha = jnp.exp2(m - shift)
          p = jnp.exp2(s2 * mult - lax.broadcast_in_dim(shift, s2.shape, [0]))
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          l = l * alpha + p.sum(axis=1)
          p16 = dropped(p, s).astype(dtype)
          acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
          plgpu.barrier_arrive(sched)
          plgpu.barrier_wait(v_bar.at[slot])
          plgpu.barrier_wait(sched)

          def pv_product(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
            wait_next_k(s)

          acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
          plgpu.barrier_arrive(v_free.at[slot])
          return acc, m_new, l

        def skip(s, carry):
          slot = slot_of(s)
          kv_ids(slot, False)
          bias_tile(slot, False)
          plgpu.barrier_arrive(k_free.at[slot])
          wait_next_k(s)
          rendezvous()
          plgpu.barrier_wait(v_bar.at[slot])
          rendezvous()
          plgpu.barrier_arrive(v_free.at[slot])
          return carry

        acc, m, l = band_walk(step, skip, (acc, m, l), lo_c, (lo, a, bb, hi), hi_c)
        pl.when(wg == 0)(rendezvous)

        has_next = it + 1 < n_local
        if separate_o:  # Q is free now: fetch the next tile's during the epilogue
          pl.when(has_next)(lambda: load_q(ahead[0]))
        has = l > 0.0
        inv = dropout.keep_scale(g.dropout_rate) / jnp.where(has, l, 1.0)
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
        lse2 = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), -jnp.inf)
        # The previous tile's stores must have read the staging buffers.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def store_tile():
          my_o[...] = out.astype(dtype)
          lse_smem.at[wg][...] = lse2 * (1.0 / LOG2E)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(my_o, o_ref.at[b_idx, pl.ds(r0, bq), h])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b_idx, h, pl.ds(r0, bq)])

        def store_part():
          # A tail part: its normalised output as a high and a low half in the
          # input dtype (an fp32 staging buffer does not fit; the halves carry
          # ~16 bits) and its lse in log2 units, both through the usual staging
          # buffers and TMA, for tail_merge.combine to merge with the tile's
          # other parts. (Storing fp32 straight from registers to global memory
          # cost ~5-9 us per part on an H200, 2026-11-23.)
          o_hi, o_lo, lse_part = parts
          rows = (t - tail.full, part, pl.ds(wg * bq, bq))
          hi = out.astype(dtype)
          my_o[...] = hi
          lse_smem.at[wg][...] = lse2
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(my_o, o_hi.at[rows])
          plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_part.at[rows])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          my_o[...] = (out - hi.astype(jnp.float32)).astype(dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(my_o, o_lo.at[rows])

        if tail is None:
          store_tile()
        else:
          pl.when(whole)(store_tile)
          pl.when(jnp.logical_not(whole))(store_part)
        if not separate_o:
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          pl.when(has_next)(lambda: load_q(ahead[0]))
        return base + (hi_c - lo_c), ahead

      lax.fori_loop(0, n_local, tile_body, (jnp.int32(0), first()))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(pipeline.REGISTERS[1], action="decrease")

      first, take = walks_ahead(g, n_local, unit, visible)

      def tile_body(it, carry):
        base, ahead = carry
        (t, _, _, _, lo_c, hi_c), ahead = take(it, ahead)
        b_idx, h, _ = tile_coords(g, t)
        load_k, load_v = pipeline.kv_loader(
            g, (k_ref, v_ref), (k_smem, v_smem), (k_bar, v_bar), b_idx,
            lax.div(h, jnp.int32(g.group)))
        if g.segments and not g.segment_spans:
          load_k = pipeline.with_ids(load_k, g, kid_ref, kid_smem, kid_bar, b_idx)
        if g.bias_dtype is not None:
          load_k = with_bias(load_k, b_idx, h, tile_coords(g, t)[2])

        @pl.loop(lo_c, hi_c)
        def _step(s):
          pipeline.ring_fill(base + s - lo_c, stages, (
              (k_free, lambda slot: load_k(s, slot)),
              (v_free, lambda slot: load_v(s, slot))))

        return base + (hi_c - lo_c), ahead

      def with_bias(load, b_idx, h, tile):
        return pipeline.with_tile(load, g, bias_ref, bias_smem, bias_bar, b_idx, h,
                                  lambda w: pl.ds(tile * (2 * bq) + w * bq, bq),
                                  lambda s: pl.ds(s * bk, bk))

      lax.fori_loop(0, n_local, tile_body, (jnp.int32(0), first()))

  order = None
  if g.balanced:
    order = jnp.asarray(balanced_order(g, segments[2] if g.segments else None))
  n_in = len(segments) + (bias is not None) + (seed is not None) + (order is not None)


  def entry(q_ref, k_ref, v_ref, *refs):
    q_ref, k_ref, v_ref, _ = windows(g, q_ref, k_ref, v_ref)
    seg_refs, (o_ref, lse_ref, *parts) = refs[:len(segments)], refs[n_in:]
    bias_ref = refs[len(segments)] if bias is not None else None
    seed_ref = refs[len(segments) + (bias is not None)] if seed is not None else None
    order_ref = refs[n_in - 1] if order is not None else None
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (
        plgpu.SMEM((2, bq, d), dtype, transforms=tiled),
        plgpu.SMEM((stages, bk, d), dtype, transforms=tiled),
        plgpu.SMEM((stages, bk, d), dtype, transforms=tiled),
        plgpu.SMEM((2, bq), jnp.float32),
    ) + ((plgpu.SMEM((2, bq, d), dtype, transforms=tiled),) if separate_o else ())
    bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2))
    free = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2
    seg_scoped = pipeline.segment_scoped(g, bq, bk)

    bias_scoped = (pipeline.tile_slots(g.bias_dtype, stages, bq, bk)
                   if g.bias_dtype is not None else ())

    def scoped_kernel(smem, bars, free, sched, *extra):
      seg = add = None
      if g.segments:
        seg, extra = (seg_refs,) + pipeline.segment_buffers(*extra[:2]), extra[2:]
      if g.bias_dtype is not None:
        add = (bias_ref,) + tuple(extra[:2])
      kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, parts, seg, add, seed_ref, order_ref,
             smem, bars, free, sched)

    pl.run_scoped(scoped_kernel, smem, bars, free, plgpu.Barrier(num_arrivals=2),
                  *seg_scoped, *bias_scoped, collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((g.batch, g.seq_q_padded, g.heads_q, d), dtype),
              jax.ShapeDtypeStruct((g.batch, g.heads_q, g.seq_q_padded), jnp.float32))
  if tail is not None:
    rows = (tail.count, tail.parts, 2 * bq)
    out_type += (jax.ShapeDtypeStruct(rows + (d,), dtype),) * 2 + (
        jax.ShapeDtypeStruct(rows, jnp.float32),)
  outs = plgpu.kernel(
      entry, out_type=out_type, grid=(ctas,), grid_names=("cta",),
      num_threads=3, thread_name="wg",
      compiler_params=_PARAMS,
  )(q, k, v, *segments, *(() if bias is None else (bias,)),
    *(() if seed is None else (seed,)), *(() if order is None else (order,)))
  if tail is None:
    return outs
  out, lse, o_hi, o_lo, lse_part = outs

  def coords(t):
    b_idx, h, tile = tile_coords(g, t)
    return tile, b_idx, h

  # Normalised parts (no l): each weighs 2^(lse - max lse).
  return tail_merge.combine(out, lse, ((o_hi, o_lo), lse_part, None), tail, coords,
                            2 * bq, interpret=False)
