"""Autotuning of the triton platform's launches (block sizes, warps, stages) with
the shared persistent cache of common/autotune.py: ``FLASHJAX_AUTOTUNE=1`` tunes
the first call of each (device, shape class) on the GPU; the winner is stored in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/triton.json``) under keys
prefixed ``triton|``, and later calls and processes read it."""

from __future__ import annotations

import dataclasses

from ..common import autotune as common
from .plan import Launch, TritonKernelsConfig

FWD_CANDIDATES = (
    Launch(block_q=128, block_kv=64, num_warps=8, num_stages=3),
    Launch(block_q=128, block_kv=128, num_warps=8, num_stages=3),
    Launch(block_q=128, block_kv=64, num_warps=4, num_stages=3),
    Launch(block_q=64, block_kv=64, num_warps=4, num_stages=3),
    Launch(block_q=128, block_kv=32, num_warps=4, num_stages=4),
)
BWD_CANDIDATES = (
    (Launch(block_q=64, block_kv=64, num_warps=4, num_stages=2),) * 2,
    (Launch(block_q=128, block_kv=64, num_warps=8, num_stages=2),
     Launch(block_q=64, block_kv=128, num_warps=8, num_stages=2)),
    (Launch(block_q=64, block_kv=64, num_warps=8, num_stages=3),) * 2,
)
# D > 128: tiles of 256 columns leave room for narrow tiles only.
WIDE_FWD_CANDIDATES = (
    Launch(block_q=64, block_kv=32, num_warps=4, num_stages=2),
    Launch(block_q=64, block_kv=64, num_warps=8, num_stages=2),
    Launch(block_q=128, block_kv=32, num_warps=8, num_stages=2),
)
WIDE_BWD_CANDIDATES = (
    (Launch(block_q=32, block_kv=32, num_warps=4, num_stages=1),) * 2,
    (Launch(block_q=64, block_kv=32, num_warps=4, num_stages=2),
     Launch(block_q=32, block_kv=64, num_warps=4, num_stages=2)),
    (Launch(block_q=64, block_kv=64, num_warps=8, num_stages=1),) * 2,
)


def candidates(spec):
  if max(spec.head_dim, spec.head_dim_v) > 128:
    return WIDE_FWD_CANDIDATES, WIDE_BWD_CANDIDATES
  return FWD_CANDIDATES, BWD_CANDIDATES


def _from_json(d: dict) -> TritonKernelsConfig:
  return TritonKernelsConfig(fwd=Launch(**d["fwd"]), dq=Launch(**d["dq"]),
                             dkv=Launch(**d["dkv"]),
                             fp32_precision=d.get("fp32_precision", "ieee"))


CACHE = common.JsonCache("triton", dataclasses.asdict, _from_json, key_prefix="triton|")


def tune(spec, run, *, timer=common.default_timer,
         base: TritonKernelsConfig | None = None) -> TritonKernelsConfig:
  """Times the forward candidates, then the backward ones with the winning
  forward; the base config competes in both; the winner is cached."""
  return common.in_fresh_thread(_tune, spec, run, timer, base or TritonKernelsConfig())


def _tune(spec, run, timer, base):
  fwd_cands, bwd_cands = candidates(spec)
  fwd_cands = (base.fwd,) + tuple(c for c in fwd_cands if c != base.fwd)
  bwd_cands = ((base.dq, base.dkv),) + tuple(c for c in bwd_cands
                                             if c != (base.dq, base.dkv))
  best = lambda cfgs, grad: common.fastest(cfgs, run, grad, timer, "triton")
  fwd = best([dataclasses.replace(base, fwd=c) for c in fwd_cands], False).fwd
  with_fwd = dataclasses.replace(base, fwd=fwd)
  cfg = best([dataclasses.replace(with_fwd, dq=dq, dkv=dkv) for dq, dkv in bwd_cands],
             True)
  CACHE.store(spec, cfg)
  return cfg


def resolve_config(spec, config, flash_attention, *, on_gpu: bool):
  """An explicit config, else the cache's winner, else (FLASHJAX_AUTOTUNE=1 on a
  GPU) a fresh tuning run, else the heuristic default."""
  from .plan import default_config
  if config is not None:
    return config
  cached = CACHE.lookup(spec)
  if cached is not None:
    return cached
  if common.enabled() and on_gpu:
    return tune(spec, common.random_run(spec, flash_attention),
                base=default_config(spec))
  return default_config(spec)
