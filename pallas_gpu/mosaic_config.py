"""Tiles of the Pallas Mosaic-GPU platform (Hopper) and their default: imported by
the platform's entry (mosaic.py) and its autotuning (mosaic_autotune.py)."""

from __future__ import annotations

import dataclasses

from .triton_plan import TritonConfig

HEAD_DIMS = (64, 128, 256)
BACKWARD_KERNELS = ("mosaic", "triton")
MOSAIC_BWD_MAX_HEAD_DIM = 128
# The forward's additive tile (bias / mask) needs the smaller K/V ring of 64-key
# blocks beside it in shared memory.
BIAS_MAX_HEAD_DIM = 128
BIAS_BLOCK_KV = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """Forward and backward tiles; ``backward`` configures the Pallas-Triton
  backward where that one runs.

  Attributes:
    block_q: forward and dQ query rows per compute warpgroup (a CTA owns two).
    block_kv: forward keys per pipeline step.
    stages: forward K/V shared-memory slots in flight.
    persistent: forward with one CTA per SM walking the q tiles (True), one CTA
      per q tile (False), or None: persistent unless the band is causal or a
      window (uneven tiles balance better on the hardware scheduler).
    backward_kernel: "mosaic" (the Mosaic-GPU dQ and dK/dV kernels, head dims
      <= 128) or "triton" (Pallas-Triton's backward).
    dq_block_kv: dQ keys per pipeline step.
    dq_stages: dQ K/V shared-memory slots in flight.
    dkv_block_q: dK/dV query rows per pipeline step.
    dkv_block_kv: dK/dV keys per compute warpgroup (a CTA owns two).
    dkv_stages: dK/dV Q/dO shared-memory slots in flight.
    bwd_one_launch: run the dQ and dK/dV kernels as one launch (one grid tail
      instead of two) rather than one after the other.
    split_tail: the persistent forward runs its last, partial round of q tiles
      as key ranges merged by a small second kernel (triton_tail.py); applies to
      the full band only, where the plan finds a split that pays. The default
      config turns it on for D <= 64 with more than 2048 keys only. On an H200
      (2026-11-23, device time per call) it made the D = 64 B2 S8k H32 forward
      4.8% faster; at D = 128 it was 1.1% faster at B2 S8k but 1.4% slower at
      B8 S2k and mixed at B1 S16k, so it stays off there.
  """

  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  persistent: bool | None = None
  backward_kernel: str = "mosaic"
  dq_block_kv: int = 64
  dq_stages: int = 2
  dkv_block_q: int = 64
  dkv_block_kv: int = 64
  dkv_stages: int = 2
  bwd_one_launch: bool = True
  split_tail: bool = False
  backward: TritonConfig | None = None

  def __post_init__(self):
    if self.block_q != 64:
      raise ValueError(f"block_q must be 64 (one wgmma M tile), got {self.block_q}")
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
    for name in ("stages", "dq_stages", "dkv_stages"):
      if getattr(self, name) < 2:
        raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
    if self.backward_kernel not in BACKWARD_KERNELS:
      raise ValueError(f"backward_kernel must be one of {BACKWARD_KERNELS}, got "
                       f"{self.backward_kernel!r}")
    for name in ("bwd_one_launch", "split_tail"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.dq_block_kv not in (64, 128):
      raise ValueError(f"dq_block_kv must be 64 or 128, got {self.dq_block_kv}")
    if self.dkv_block_kv != 64:
      raise ValueError(f"dkv_block_kv must be 64 (one wgmma M tile), got "
                       f"{self.dkv_block_kv}")
    # dK += dS^T Q contracts over the q rows: Mosaic-GPU wants 64-multiples.
    if self.dkv_block_q not in (64, 128):
      raise ValueError(f"dkv_block_q must be 64 or 128, got {self.dkv_block_q}")


def padded_head_dim(spec) -> int | None:
  d = max(spec.head_dim, spec.head_dim_v)
  return next((x for x in HEAD_DIMS if x >= d), None)


def default_config(spec: spec_lib.AttentionSpec) -> MosaicConfig:
  """Shared memory holds 2 q blocks and ``stages`` K and V blocks: D = 256 keeps
  64-key blocks so two stages fit in 227 KiB. The split tail only where it was
  measured to pay (D = 64, long keys; see MosaicConfig)."""
  d = padded_head_dim(spec) or 256
  if has_additive_tile(spec):
    return MosaicConfig(block_kv=BIAS_BLOCK_KV, stages=2)
  if d <= 64:
    return MosaicConfig(block_kv=128, stages=3, split_tail=spec.seq_k > 2048)
  if d <= 128:
    return MosaicConfig(block_kv=128, stages=2)
  return MosaicConfig(block_kv=64, stages=2)


def has_additive_tile(spec) -> bool:
  """A bias or dense mask: the forward streams one additive tile; the backward is
  Pallas-Triton's."""
  return spec.bias_shape is not None or spec.mask_shape is not None


def uses_mosaic_backward(spec, config: MosaicConfig) -> bool:
  return (config.backward_kernel == "mosaic" and not has_additive_tile(spec) and
          padded_head_dim(spec) <= MOSAIC_BWD_MAX_HEAD_DIM)
