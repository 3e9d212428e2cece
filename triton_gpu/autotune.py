"""Autotuning of the triton platform's launches (block sizes, warps, stages) with
the shared persistent cache of common/autotune.py: ``FLASHJAX_AUTOTUNE=1`` tunes
the first call of each (device, shape class) on the GPU; the winner is stored in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/triton.json``) under keys
prefixed ``triton|``, and later calls and processes read it."""

from __future__ import annotations

import dataclasses

from ..common import autotune as common
from .plan import KernelConfig, KernelsConfig, default_config

FWD_CANDIDATES = (
    KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3),
    KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3),
    KernelConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3),
    KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3),
    KernelConfig(block_q=128, block_kv=32, num_warps=4, num_stages=4),
)
BWD_CANDIDATES = (
    (KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2),) * 2,
    (KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2),
     KernelConfig(block_q=64, block_kv=128, num_warps=8, num_stages=2)),
    (KernelConfig(block_q=64, block_kv=64, num_warps=8, num_stages=3),) * 2,
)
# D > 128: tiles of 256 columns leave room for narrow tiles only.
WIDE_FWD_CANDIDATES = (
    KernelConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
    KernelConfig(block_q=64, block_kv=64, num_warps=8, num_stages=2),
    KernelConfig(block_q=128, block_kv=32, num_warps=8, num_stages=2),
)
WIDE_BWD_CANDIDATES = (
    (KernelConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1),) * 2,
    (KernelConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
     KernelConfig(block_q=32, block_kv=64, num_warps=4, num_stages=2)),
    (KernelConfig(block_q=64, block_kv=64, num_warps=8, num_stages=1),) * 2,
)


def candidates(spec):
  if max(spec.head_dim, spec.head_dim_v) > 128:
    return WIDE_FWD_CANDIDATES, WIDE_BWD_CANDIDATES
  return FWD_CANDIDATES, BWD_CANDIDATES


CACHE = common.JsonCache("triton", dataclasses.asdict, KernelsConfig.from_json,
                         key_prefix="triton|")


def tune(spec, run, *, timer=common.default_timer,
         base: KernelsConfig | None = None) -> KernelsConfig:
  """Times the candidates for ``spec`` and caches the winner
  (:func:`common.autotune.tune_kernels`)."""
  return common.tune_kernels(spec, run, candidates=candidates(spec), cache=CACHE,
                             base=base or KernelsConfig(), timer=timer)


def resolve_config(spec, config, flash_attention, *, on_gpu: bool):
  """Explicit, else cached, else tuned (FLASHJAX_AUTOTUNE=1 on a GPU), else the
  heuristic default (common/autotune.py)."""
  return common.resolve(spec, config, cache=CACHE, tune=tune, attention=flash_attention,
                        default=default_config(spec), may_tune=on_gpu)
