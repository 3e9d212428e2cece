"""Autotuning of the Pallas-Triton tiles, with a persistent cache.

With ``FLASHJAX_AUTOTUNE=1`` (or :func:`tune` called directly), the first call of a
shape class times each candidate forward config on random inputs of that shape,
then each backward candidate with the winning forward, and stores the winners in a
JSON cache keyed by device kind and shape class (sequence lengths rounded up to
powers of two, head dims, grouping, dtype, band kind and features). Later calls,
in this process or another, read the cache without timing. The cache lives in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/pallas_triton.json``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from ..common import timer as timer_lib
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


def enabled() -> bool:
  return os.environ.get("FLASHJAX_AUTOTUNE", "").lower() in ("1", "true", "on")


def cache_path() -> str:
  return os.environ.get("FLASHJAX_AUTOTUNE_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "flashjax", "pallas_triton.json")


def shape_class(spec) -> str:
  up = lambda n: 1 << max(0, (n - 1).bit_length())
  band = spec.band
  kind = "full" if band.is_full else f"band{band.left},{band.right}"
  feats = ",".join(sorted(spec.features - {"lse", "causal", "window"}))
  try:
    device = jax.devices()[0].device_kind
  except RuntimeError:
    device = "unknown"
  return (f"{device}|{spec.dtype}|D{spec.head_dim}/{spec.head_dim_v}|"
          f"G{spec.group_size}|S{up(spec.seq_q)}x{up(spec.seq_k)}|{kind}|{feats}")


def _load() -> dict:
  try:
    with open(cache_path()) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _to_json(cfg: TritonConfig) -> dict:
  return dataclasses.asdict(cfg)


def _from_json(d: dict) -> TritonConfig:
  return TritonConfig(fwd=KernelConfig(**d["fwd"]), dq=KernelConfig(**d["dq"]),
                      dkv=KernelConfig(**d["dkv"]),
                      fp32_precision=d.get("fp32_precision", "ieee"))


def lookup(spec) -> TritonConfig | None:
  entry = _load().get(shape_class(spec))
  return None if entry is None else _from_json(entry)


def _store(spec, cfg: TritonConfig):
  path = cache_path()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  data = _load()
  data[shape_class(spec)] = _to_json(cfg)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
  os.replace(tmp, path)  # atomic: concurrent tuners never leave a torn file


def _time_ms(fn, args) -> float:
  return timer_lib.time_ms(fn, args, iters=5, repeats=3)


def tune(spec, run, *, timer=_time_ms, base: TritonConfig | None = None) -> TritonConfig:
  """Times the candidates for ``spec`` and caches the winner.

  ``run(config, with_grad)`` returns ``(fn, args)``: a jitted function of the
  candidate and its inputs. Candidates that fail to compile (e.g. too much shared
  memory for a head dim) are skipped.
  """
  base = base or TritonConfig()
  # Tuning usually starts while an outer jit is tracing; JAX's trace context is
  # per thread, so a fresh thread runs the candidates for real instead of staging
  # them into that trace.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(_tune, spec, run, timer, base).result()


def _tune(spec, run, timer, base):
  def best(configs, with_grad):
    timed = []
    for cfg in configs:
      try:
        fn, args = run(cfg, with_grad)
        timed.append((timer(fn, args), cfg))
      except Exception:  # a candidate that does not fit this device is skipped
        continue
    if not timed:
      raise NotImplementedError("pallas-triton autotune: no candidate ran")
    return min(timed, key=lambda t: t[0])[1]

  fwd_cands, bwd_cands = candidates(spec)
  # The base config competes too, so tuning never picks worse than the default.
  fwd_cands = (base.fwd,) + tuple(c for c in fwd_cands if c != base.fwd)
  bwd_cands = ((base.dq, base.dkv),) + tuple(c for c in bwd_cands
                                             if c != (base.dq, base.dkv))
  fwd = best([dataclasses.replace(base, fwd=c) for c in fwd_cands], False).fwd
  with_fwd = dataclasses.replace(base, fwd=fwd)
  cfg = best([dataclasses.replace(with_fwd, dq=dq, dkv=dkv)
              for dq, dkv in bwd_cands], True)
  _store(spec, cfg)
  return cfg


def random_run(spec, attention):
  """The ``run`` of :func:`tune` for plain calls of ``spec``'s shape (features that
  need extra arrays are tuned without them: tiles depend on shape, not on them)."""
  def inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    dt = jnp.dtype(spec.dtype)
    shape = lambda h, d, s: (spec.batch, s, h, d)
    return (jax.random.normal(keys[0], shape(spec.heads_q, spec.head_dim, spec.seq_q), dt),
            jax.random.normal(keys[1], shape(spec.heads_kv, spec.head_dim, spec.seq_k), dt),
            jax.random.normal(keys[2], shape(spec.heads_kv, spec.head_dim_v, spec.seq_k),
                              dt))

  kwargs = dict(causal=spec.causal, softmax_scale=spec.softmax_scale,
                sliding_window=None if spec.band.left is None and (
                    spec.band.right in (None, 0)) else (spec.band.left, spec.band.right))

  def run(cfg, with_grad):
    f = lambda q, k, v: attention(q, k, v, config=cfg, **kwargs)
    if not with_grad:
      return jax.jit(f), inputs()
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)),
                         argnums=(0, 1, 2)))
    return g, inputs()

  return run
