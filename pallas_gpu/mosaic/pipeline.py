"""The memory warpgroup of the Mosaic-GPU kernels: a ring of ``num_stages``
shared-memory slots filled by TMA. Each operand of a slot has its own release
barrier and is refilled as soon as its consumers are done with it, not when the
whole slot is free, so an operand released early in a step (the forward's K,
after QK^T) loads a step and a half ahead instead of one (at B8 S2k this took the
forward from 0.75x to 1.0x cuDNN). Shared by the forward (``ring_fill`` across
persistent tiles) and the dQ and dK/dV kernels (``produce``, one tile per CTA)."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ...common import compat
from ...common.mask import band_allowed
from .blocks import additive_tiling

# Registers per thread of (each compute warpgroup, the memory warpgroup). A CTA
# of three warpgroups launches with 168 x 384 registers; setmaxnreg only moves
# them between warpgroups, and asking for more than that never returns (2 x 240
# + 40 hung at D = 256). Both splits use them all. The forward keeps the narrow
# one (240/24 was 0.7-1.6% slower there, H200, 2026-11-23); the backward's
# choice is bwd.registers.
REGISTERS = (232, 40)
REGISTERS_WIDE = (240, 24)


def produce(lo_c, hi_c, num_stages: int, loads, registers: int, rounds: int = 1):
  """The memory warpgroup of a one-tile CTA, with ``registers`` per thread: fills
  the ring for steps ``[lo_c, hi_c)``, ``rounds`` times over, one step count
  across the rounds (the dK/dV kernel's rounds are a kv head's query heads);
  ``loads(r)`` gives round ``r``'s ``(free, load(s, slot))`` pairs, in the
  order the consumers release them (see :func:`ring_fill`)."""
  plgpu.set_max_registers(registers, action="decrease")

  def fill(step, s, pairs):
    ring_fill(step, num_stages, [(free, lambda slot, load=load: load(s, slot))
                                 for free, load in pairs])

  # One round walks the steps themselves: no division or remainder per step.
  if rounds == 1:
    pl.loop(lo_c, hi_c)(lambda s: fill(s - lo_c, s, loads(0)))
    return
  n = hi_c - lo_c
  pl.loop(0, rounds * n)(
      lambda i: fill(i, lo_c + lax.rem(i, n), loads(lax.div(i, n))))


def ring_slot(step, num_stages: int):
  """The ring slot of global pipeline step ``step``: producer and consumers
  count the same steps, so they meet in the same slot."""
  return lax.rem(step, jnp.int32(num_stages))


def ring_fill(step, num_stages: int, loads):
  """Fills the ring slot of global pipeline step ``step`` (``step % num_stages``):
  each ``(free, load)`` pair waits, from the ring's second round on, until every
  consumer released the slot's previous contents on ``free``, then issues
  ``load(slot)``. A persistent kernel keeps counting steps across its tiles, so
  slots and barrier phases stay in step."""
  slot = ring_slot(step, num_stages)
  for free, load in loads:
    pl.when(step >= num_stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
    load(slot)


def copy_block(ref, rows, slot, barrier):
  """Copies the block ``ref[rows]`` into ``slot`` by TMA, on ``barrier``."""
  plgpu.copy_gmem_to_smem(ref.at[rows], slot, barrier)


def kv_loader(g, refs, smems, bars, b_idx, kv_head, copy=copy_block):
  """``(load_k, load_v)``: each ``load(s, slot)`` copies block ``s`` (``g.block_kv``
  keys) of one (batch, kv head) of K or V into ``slot``, with its own barrier,
  by ``copy(ref, rows, slot, barrier)``."""
  def loader(ref, smem, bar):
    def load(s, slot):
      rows = (b_idx, pl.ds(s * g.block_kv, g.block_kv), kv_head)
      copy(ref, rows, smem.at[slot], bar.at[slot])
    return load
  return tuple(loader(*x) for x in zip(refs, smems, bars))


def with_ids(load, g, ids_ref, ids_smem, ids_bar, b_idx):
  """``load(s, slot)`` that also copies block ``s``'s segment ids (``g.block_kv``
  of them) of batch ``b_idx`` into ``ids_smem[slot]`` with its own barrier."""
  def load_both(s, slot):
    load(s, slot)
    plgpu.copy_gmem_to_smem(ids_ref.at[b_idx, pl.ds(s * g.block_kv, g.block_kv)],
                            ids_smem.at[slot], ids_bar.at[slot])
  return load_both


def tile_slots(dtype, stages: int, own: int, streamed: int, transposed: bool = False):
  """Ring slots of the additive (bias / mask) tile, ``dtype``: per stage, both
  compute warpgroups' ``(own, streamed)`` tiles (rows by keys in the forward and
  dQ), or with ``transposed`` their ``(streamed, own)`` blocks of the tile, read
  as ``(own, streamed)`` (keys by rows in dK/dV); and one barrier per stage and
  warpgroup."""
  shape = (streamed, own) if transposed else (own, streamed)
  return (plgpu.SMEM((stages, 2) + shape, jnp.dtype(dtype),
                     transforms=additive_tiling(dtype, shape[1])),
          plgpu.Barrier(num_barriers=2 * stages))


def with_tile(load, g, tile_ref, smem, bars, b_idx, h, own, streamed,
              transposed: bool = False):
  """``load(s, slot)`` that also copies both warpgroups' blocks of the additive
  operand ``tile_ref [B|1, H|1, Sqp, Skp]`` into the slot of :func:`tile_slots`,
  one barrier per warpgroup: rows ``own(w)`` by columns ``streamed(s)``, or with
  ``transposed`` rows ``streamed(s)`` by columns ``own(w)``."""
  bi = b_idx if g.bias_batch else 0
  hi = h if g.bias_heads else 0

  def load_both(s, slot):
    load(s, slot)
    for w in (0, 1):
      at = (streamed(s), own(w)) if transposed else (own(w), streamed(s))
      plgpu.copy_gmem_to_smem(tile_ref.at[(bi, hi) + at], smem.at[slot, w],
                              bars.at[2 * slot + w])
  return load_both


def slot_tile(smem, bars, slot, wg, load: bool = True, raw: bool = False,
              transposed: bool = False):
  """Warpgroup ``wg``'s additive tile of ring slot ``slot`` (:func:`tile_slots`)
  in registers, as stored with ``raw`` (for :func:`tile_logits` later), else
  as fp32; None without ``load``. Every step waits, so the barriers' phases
  stay in step. A ``transposed`` slot is read through a transposed view into
  the WGMMA_TRANSPOSED layout (each thread's pairs then lie along a stored
  row) and moved to the WGMMA layout in registers (a lane shuffle and a byte
  permute per register, for 16- and 32-bit values: a float8 tile goes as
  fp16), which spares XLA a transposed copy of the whole tile."""
  plgpu.barrier_wait(bars.at[2 * slot + wg])
  if not load:
    return None
  if not transposed:
    tile = compat.mgpu_load(smem.at[slot, wg], plgpu.Layout.WGMMA)
    return tile if raw else tile_logits(tile)
  assert not raw
  tile = compat.mgpu_load(compat.transpose_ref(smem.at[slot, wg], (1, 0)),
                          plgpu.Layout.WGMMA_TRANSPOSED)
  return tile_logits(plgpu.layout_cast(_widened(tile), plgpu.Layout.WGMMA))


def _widened(tile):
  """An 8-bit tile as fp16 (Mosaic-GPU converts 8-bit floats to 16-bit ones
  only: cvt.f16x2.e5m2x2); a wider one as it is."""
  return tile.astype(jnp.float16) if jnp.dtype(tile.dtype).itemsize == 1 else tile


def tile_logits(tile):
  """An additive tile in registers as fp32 logits."""
  return _widened(tile).astype(jnp.float32)


def slot_ids(bar, smem, slot, layout, load: bool = True):
  """Waits for slot ``slot``'s segment ids (every step waits, so the barrier's
  phases stay in step) and, if ``load``, reads them into registers in ``layout``."""
  plgpu.barrier_wait(bar.at[slot])
  return compat.mgpu_load(smem.at[slot], layout) if load else None


def skip_slot(slot, waits, reads, frees):
  """A walk step over a block the band leaves out (blocks.band_walk's skip):
  waits for the slot's ``waits`` barriers, passes it through ``reads``
  (``read(slot, False)``: the waits on the ids' and tile's own barriers, no
  load) and releases it through ``frees``, so that every barrier's phases
  stay in step with the memory warpgroup's."""
  for bar in waits:
    plgpu.barrier_wait(bar.at[slot])
  for read in reads:
    read(slot, False)
  for bar in frees:
    plgpu.barrier_arrive(bar.at[slot])


def in_spans(index, spans, shape):
  """Whether each ``index`` of a ``shape`` tile lies in its row's span: ``spans``
  is ``[starts, ends]`` per row (dim 0), from :func:`own_rows`."""
  lo, hi = (lax.broadcast_in_dim(x, shape, [0]) for x in spans)
  return (index >= lo) & (index < hi)


def allowed(g, q_pos, k_pos, own, streamed_ids, shape, over_kv: bool = True):
  """Which elements of a masked step's ``shape`` tile are allowed, or None for
  all: ``q_pos`` and ``k_pos`` are the tile's query and key positions, ``own``
  the own rows' (keys' with ``over_kv=False``) operand from :func:`own_rows`
  along dim 0, ``streamed_ids`` the other side's ids along dim 1. With spans,
  the own positions' spans of the other side's (the band and the real length
  are in them); else keys below Sk (where the own side is queries: the dK/dV
  kernel cuts off keys past Sk), the band and equal ids."""
  if g.segment_spans:
    return in_spans(k_pos if over_kv else q_pos, own, shape)
  ok = k_pos < g.seq_k if over_kv else None
  if not g.band.is_full:
    band = band_allowed(q_pos, k_pos, g.band)
    ok = band if ok is None else ok & band
  if g.segments:
    same = (lax.broadcast_in_dim(own[0], shape, [0]) ==
            lax.broadcast_in_dim(streamed_ids, shape, [1]))
    ok = same if ok is None else ok & same
  return ok


def own_rows(bar, smem, wg, layout, spans: bool):
  """Waits for warpgroup ``wg``'s own segment operand in ``smem[wg]`` and reads
  it into registers: ``[ids]``, or with ``spans`` ``[span starts, span ends]``
  (mosaic.segment_operands)."""
  if not spans:
    return [slot_ids(bar, smem, wg, layout)]
  plgpu.barrier_wait(bar.at[wg])
  return [compat.mgpu_load(smem.at[wg, i], layout) for i in range(2)]


def own_window(ids_ref, b_idx, start, n: int, spans: bool):
  """The ``n`` own positions from ``start`` of batch ``b_idx`` in ``ids_ref``
  (``[B, S]`` ids, or with ``spans`` ``[B, 2, S]`` span starts and ends)."""
  if spans:
    return ids_ref.at[b_idx, :, pl.ds(start, n)]
  return ids_ref.at[b_idx, pl.ds(start, n)]


def own_ids(ids_ref, smem, bar, b_idx, start, n: int, wg, layout, spans: bool):
  """:func:`own_rows` of warpgroup ``wg``'s own ``n`` rows (or keys) from
  ``start`` (:func:`own_window`), copied into its slot."""
  plgpu.copy_gmem_to_smem(own_window(ids_ref, b_idx, start, n, spans), smem.at[wg],
                          bar.at[wg])
  return own_rows(bar, smem, wg, layout, spans)


def segment_scoped(g, own: int, streamed: int):
  """Shared memory and barriers for the segment operands of a CTA's two
  warpgroup blocks (``own`` positions each: ids, or with ``g.segment_spans``
  span starts and ends) and, without spans, for the ids streamed with each ring
  slot (``streamed`` each); ``()`` without segment ids. Read them back with
  :func:`segment_buffers`."""
  if not g.segments:
    return ()
  if g.segment_spans:
    return ((plgpu.SMEM((2, 2, own), jnp.int32),), (plgpu.Barrier(num_barriers=2),))
  return ((plgpu.SMEM((2, own), jnp.int32), plgpu.SMEM((g.num_stages, streamed), jnp.int32)),
          (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=g.num_stages)))


def segment_buffers(smem, bars):
  """:func:`segment_scoped`'s buffers as ``((own, streamed), (own barriers,
  streamed barriers))``, the streamed ones None with spans."""
  pad = lambda x: (tuple(x) + (None,))[:2]
  return pad(smem), pad(bars)
