"""Tuning configuration of the Pallas Mosaic-TPU kernels.

Block sizes follow TPU layout rules: ``block_kv`` is a lane dimension (the key axis
of scores, bias and kv segment ids), so a multiple of 128; ``block_q`` is a sublane
dimension, a multiple of 8 (16 for 16-bit inputs, which pack two rows per sublane).
The per-generation defaults are reasoned from VMEM sizes, not measured: no TPU was
available to this project.
"""

from __future__ import annotations

import dataclasses

from ..common import hardware, platform
from ..common.blocking import round_up

NUM_LANES = 128


def _check(name, value, multiple):
  if not isinstance(value, int) or isinstance(value, bool) or value < multiple or (
      value % multiple):
    raise ValueError(f"{name} must be a positive multiple of {multiple}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  block_q: int = 128
  block_kv: int = 128

  def __post_init__(self):
    _check("block_q", self.block_q, 16)
    _check("block_kv", self.block_kv, NUM_LANES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuConfig:
  """Forward and backward blocks (the backward holds more tiles per step)."""

  fwd: BlockSizes = BlockSizes()
  bwd: BlockSizes = BlockSizes()
  # Counts executed kv steps per (batch, head, q block) into an extra output;
  # for tests of block skipping, not for production.
  count_steps: bool = False


# Unmeasured: scores tiles of 512 x 512 fp32 (1 MiB) fit the 16 MiB default scoped
# VMEM of v4/v5p with double-buffered q/k/v; v5e/v6e have less VMEM per core.
_GENERATION_DEFAULTS = {
    "v4": TpuConfig(fwd=BlockSizes(block_q=512, block_kv=512),
                    bwd=BlockSizes(block_q=256, block_kv=512)),
    "v5p": TpuConfig(fwd=BlockSizes(block_q=512, block_kv=512),
                     bwd=BlockSizes(block_q=256, block_kv=512)),
    "v5e": TpuConfig(fwd=BlockSizes(block_q=256, block_kv=512),
                     bwd=BlockSizes(block_q=256, block_kv=256)),
    "v6e": TpuConfig(fwd=BlockSizes(block_q=512, block_kv=1024),
                     bwd=BlockSizes(block_q=256, block_kv=512)),
}


def default_config(spec) -> TpuConfig:
  """Per TPU generation (untested on hardware); 128 x 128 where none is found
  (interpret mode on CPU), clipped to the padded problem size."""
  base = _GENERATION_DEFAULTS.get(hardware.tpu_generation(), TpuConfig())
  clip = lambda b: BlockSizes(block_q=min(b.block_q, round_up(spec.seq_q, 16)),
                              block_kv=min(b.block_kv, round_up(spec.seq_k, NUM_LANES)))
  return TpuConfig(fwd=clip(base.fwd), bwd=clip(base.bwd))


# jax-flash-attn2's ``blocksize_q``/``blocksize_k``: the forward's and the
# backward's blocks.
config_from_block_sizes = platform.block_sizes(default_config, ("fwd", "bwd"))
