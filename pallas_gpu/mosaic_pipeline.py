"""The memory warpgroup of the Mosaic-GPU kernels: a ring of ``stages``
shared-memory slots filled by TMA, each slot refilled once every consumer has
released it. Shared by the forward, dQ and dK/dV kernels."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax


def produce(lo_c, hi_c, stages: int, load, free_bars):
  """Issues ``load(s, slot)`` for steps ``[lo_c, hi_c)``: the first ``stages`` at
  once, then each after waiting on every barrier of ``free_bars`` at its slot."""
  plgpu.set_max_registers(40, action="decrease")
  for i in range(stages):
    pl.when(lo_c + i < hi_c)(lambda i=i: load(lo_c + i, i))

  @pl.loop(lo_c + stages, jnp.maximum(hi_c, lo_c + stages))
  def _refill(s):
    slot = lax.rem(s - lo_c, jnp.int32(stages))
    for bar in free_bars:
      plgpu.barrier_wait(bar.at[slot])
    load(s, slot)


def kv_loader(g, refs, smems, bars, b_idx, kv_head):
  """``load(s, slot)`` copying K and V block ``s`` (``g.block_kv`` keys) of one
  (batch, kv head) into ``slot``, each with its own barrier."""
  def load(s, slot):
    rows = (b_idx, pl.ds(s * g.block_kv, g.block_kv), kv_head)
    for ref, smem, bar in zip(refs, smems, bars):
      plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot], bar.at[slot])
  return load
