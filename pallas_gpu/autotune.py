"""Autotuning of the Pallas-Triton tiles, with a persistent cache
(common/autotune.py).

With ``FLASHJAX_AUTOTUNE=1`` (or :func:`tune` called directly), the first call of a
shape class times each candidate forward config on random inputs of that shape,
then each backward candidate with the winning forward, and stores the winners in a
JSON cache keyed by device kind and shape class. Later calls, in this process or
another, read the cache without timing. The cache lives in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/pallas_triton.json``).
"""

from __future__ import annotations

import dataclasses

from ..common import autotune as common
from ..common.autotune import enabled, random_run, shape_class  # noqa: F401
from .triton_plan import KernelConfig, TritonConfig

FWD_CANDIDATES = (
    KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3),
    KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3),
    KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=2),
    KernelConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3),
    KernelConfig(block_q=128, block_kv=64, num_warps=4, num_stages=2),
    KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=4),
    KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3),
)
BWD_CANDIDATES = (
    (KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2),) * 2,
    (KernelConfig(block_q=64, block_kv=128, num_warps=8, num_stages=2),
     KernelConfig(block_q=64, block_kv=128, num_warps=8, num_stages=2)),
    (KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2),
     KernelConfig(block_q=64, block_kv=128, num_warps=8, num_stages=2)),
)

# D > 128: q/k/v/do tiles of 256 columns leave room for narrow tiles only.
WIDE_FWD_CANDIDATES = (
    KernelConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
    KernelConfig(block_q=64, block_kv=64, num_warps=8, num_stages=2),
    KernelConfig(block_q=128, block_kv=32, num_warps=8, num_stages=2),
    KernelConfig(block_q=64, block_kv=32, num_warps=8, num_stages=3),
)
WIDE_BWD_CANDIDATES = (
    (KernelConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1),) * 2,
    (KernelConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
     KernelConfig(block_q=32, block_kv=64, num_warps=4, num_stages=2)),
    (KernelConfig(block_q=64, block_kv=32, num_warps=8, num_stages=2),
     KernelConfig(block_q=32, block_kv=64, num_warps=8, num_stages=2)),
    (KernelConfig(block_q=64, block_kv=64, num_warps=8, num_stages=1),) * 2,
    (KernelConfig(block_q=128, block_kv=32, num_warps=8, num_stages=1),
     KernelConfig(block_q=32, block_kv=128, num_warps=8, num_stages=1)),
)


def candidates(spec):
  """``(forward, backward)`` candidate lists for ``spec``'s head dim."""
  if max(spec.head_dim, spec.head_dim_v) > 128:
    return WIDE_FWD_CANDIDATES, WIDE_BWD_CANDIDATES
  return FWD_CANDIDATES, BWD_CANDIDATES


CACHE = common.JsonCache("pallas_triton", dataclasses.asdict, TritonConfig.from_json)


def cache_path() -> str:
  return CACHE.path


def lookup(spec) -> TritonConfig | None:
  return CACHE.lookup(spec)


def tune(spec, run, *, timer=common.default_timer,
         base: TritonConfig | None = None) -> TritonConfig:
  """Times the candidates for ``spec`` and caches the winner
  (:func:`common.autotune.tune_kernels`)."""
  return common.tune_kernels(spec, run, candidates=candidates(spec), cache=CACHE,
                             base=base or TritonConfig(), timer=timer)
