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


def _from_json(d: dict) -> TritonConfig:
  return TritonConfig(fwd=KernelConfig(**d["fwd"]), dq=KernelConfig(**d["dq"]),
                      dkv=KernelConfig(**d["dkv"]),
                      fp32_precision=d.get("fp32_precision", "ieee"))


CACHE = common.JsonCache("pallas_triton", dataclasses.asdict, _from_json)


def cache_path() -> str:
  return CACHE.path


def lookup(spec) -> TritonConfig | None:
  return CACHE.lookup(spec)


def tune(spec, run, *, timer=common.default_timer,
         base: TritonConfig | None = None) -> TritonConfig:
  """Times the candidates for ``spec`` and caches the winner.

  ``run(config, with_grad)`` returns ``(fn, args)``: a jitted function of the
  candidate and its inputs. Candidates that fail to compile are skipped; the base
  config competes too, so tuning never picks worse than the default.
  """
  return common.in_fresh_thread(_tune, spec, run, timer, base or TritonConfig())


def _tune(spec, run, timer, base):
  fwd_cands, bwd_cands = candidates(spec)
  fwd_cands = (base.fwd,) + tuple(c for c in fwd_cands if c != base.fwd)
  bwd_cands = ((base.dq, base.dkv),) + tuple(c for c in bwd_cands
                                             if c != (base.dq, base.dkv))
  best = lambda cfgs, grad: common.fastest(cfgs, run, grad, timer, "pallas-triton")
  fwd = best([dataclasses.replace(base, fwd=c) for c in fwd_cands], False).fwd
  with_fwd = dataclasses.replace(base, fwd=fwd)
  cfg = best([dataclasses.replace(with_fwd, dq=dq, dkv=dkv) for dq, dkv in bwd_cands],
             True)
  CACHE.store(spec, cfg)
  return cfg
