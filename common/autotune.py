"""Autotuning machinery shared by the GPU platforms: a persistent JSON cache keyed by
device kind and shape class, timing of candidates on random inputs in a fresh
thread, the FLASHJAX_AUTOTUNE switch, and one search (:class:`Tuner`: rounds of
candidates, each timed against the previous round's winner, the winner cached).
Platforms supply their candidates (as :class:`Round` s) and their config's JSON
form.

The cache is ``$FLASHJAX_AUTOTUNE_CACHE`` if set, else
``~/.cache/flashjax/<platform>.json``; Mosaic-GPU's and triton's keys carry their
platform's prefix (Pallas-Triton's none), so the platforms can share one file.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp

from . import configs
from . import timer as timer_lib


def enabled() -> bool:
  return os.environ.get("FLASHJAX_AUTOTUNE", "").lower() in ("1", "true", "on")


def shape_class(spec) -> str:
  """Device kind, dtype, head dims, grouping, lengths rounded up to powers of two,
  band kind and array features."""
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


class JsonCache:
  """Winners per shape class; ``to_json``/``from_json`` convert the platform's
  frozen config."""

  def __init__(self, platform: str, to_json: Callable, from_json: Callable,
               key_prefix: str = ""):
    self.platform, self.to_json, self.from_json = platform, to_json, from_json
    self.key_prefix = key_prefix

  @property
  def path(self) -> str:
    return os.environ.get("FLASHJAX_AUTOTUNE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flashjax", f"{self.platform}.json")

  def _load(self) -> dict:
    try:
      with open(self.path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return {}

  def lookup(self, spec):
    """The cached winner, or None; an entry this config layout cannot read (one
    cached before its fields changed) is a miss, so the caller tunes again or
    takes the default."""
    entry = self._load().get(self.key_prefix + shape_class(spec))
    if entry is None:
      return None
    try:
      return self.from_json(entry)
    except (KeyError, TypeError, ValueError, AttributeError):
      return None

  def store(self, spec, cfg):
    path = self.path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = self._load()
    data[self.key_prefix + shape_class(spec)] = self.to_json(cfg)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: concurrent tuners never leave a torn file


def default_timer(fn, args) -> float:
  return timer_lib.time_ms(fn, args, iters=5, repeats=3)


def in_fresh_thread(fn, *args):
  """Runs ``fn(*args)`` in a new thread. Tuning usually starts while an outer jit
  is tracing; JAX's trace context is per thread, so a fresh thread runs the
  candidates for real instead of staging them into that trace."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(fn, *args).result()


def fastest(configs, run, with_grad: bool, timer, platform: str):
  """The config whose ``run(config, with_grad)`` times fastest; candidates that fail
  (e.g. too much shared memory for a head dim) are skipped."""
  timed = []
  for cfg in configs:
    try:
      fn, args = run(cfg, with_grad)
      timed.append((timer(fn, args), cfg))
    except Exception:  # a candidate that does not fit this device is skipped
      continue
  if not timed:
    raise NotImplementedError(f"{platform} autotune: no candidate ran")
  return min(timed, key=lambda t: t[0])[1]


@dataclasses.dataclass(frozen=True)
class Round:
  """One round of a search: ``candidates(winner so far)`` gives the configs to
  time, with the gradient (``with_grad``) or the forward only. An empty list
  skips the round."""

  with_grad: bool
  candidates: Callable


def kernel_rounds(fwd, bwd) -> tuple[Round, Round]:
  """The two rounds of a config with ``fwd``, ``dq`` and ``dkv`` kernels
  (common/launch.py): the forward's tiles (set in the config's own forward class,
  so its launch flags stay), then ``(dq, dkv)`` pairs with the winning forward."""
  tiles = lambda best, c: configs.with_part(
      best, "fwd", block_q=c.block_q, block_kv=c.block_kv, num_warps=c.num_warps,
      num_stages=c.num_stages)
  return (Round(False, lambda best: [tiles(best, c) for c in fwd]),
          Round(True, lambda best: [dataclasses.replace(best, dq=dq, dkv=dkv)
                                    for dq, dkv in bwd]))


def kernel_tuner(platform: str, config_cls, candidates, key_prefix: str = "") -> "Tuner":
  """The search of a config with ``fwd``, ``dq`` and ``dkv`` kernels: its
  :func:`kernel_rounds` over ``candidates(spec) -> (forward, backward)``,
  cached in ``dataclasses.asdict`` form (read back by ``config_cls.from_json``)."""
  return Tuner(JsonCache(platform, dataclasses.asdict, config_cls.from_json,
                         key_prefix=key_prefix),
               lambda spec: kernel_rounds(*candidates(spec)))


# Head dims above this tune from a platform's narrower candidate tables: q, k, v
# and dO tiles of 256 columns leave room for narrow tiles only.
WIDE_HEAD_DIM = 128


def by_head_dim(narrow, wide):
  """``candidates(spec) -> (forward, backward)`` of a config with ``fwd``, ``dq``
  and ``dkv`` kernels: the ``wide`` pair of tables for head dims over
  :data:`WIDE_HEAD_DIM`, else the ``narrow`` one."""
  def candidates(spec):
    return wide if max(spec.head_dim, spec.head_dim_v) > WIDE_HEAD_DIM else narrow
  return candidates


@dataclasses.dataclass(frozen=True)
class Tuner:
  """A platform's search: its cache and ``rounds(spec) -> [Round, ...]``. Each
  round times the previous winner (at first the base config) and its candidates,
  so tuning never picks worse than the default as timed."""

  cache: JsonCache
  rounds: Callable

  def lookup(self, spec):
    return self.cache.lookup(spec)

  def tune(self, spec, run, *, base, timer=default_timer):
    """Runs the rounds from ``base`` and caches the winner. ``run(config,
    with_grad)`` returns ``(fn, args)``; candidates that fail to compile are
    skipped. Runs in a fresh thread (see :func:`in_fresh_thread`)."""
    def go():
      best = base
      for r in self.rounds(spec):
        candidates = list(r.candidates(best))
        if candidates:
          unique = [best] + [c for i, c in enumerate(candidates)
                             if c != best and c not in candidates[:i]]
          best = fastest(unique, run, r.with_grad, timer, self.cache.platform)
      self.cache.store(spec, best)
      return best

    return in_fresh_thread(go)

  def resolve(self, spec, config, *, attention, default, may_tune: bool):
    """An explicit config, else the cache's winner for this device and shape
    class, else (with FLASHJAX_AUTOTUNE=1 and ``may_tune``) a fresh tuning run of
    ``attention`` from ``default``, else ``default``."""
    if config is not None:
      return config
    cached = self.lookup(spec)
    if cached is not None:
      return cached
    if enabled() and may_tune:
      return self.tune(spec, random_run(spec, attention), base=default)
    return default


def random_run(spec, attention):
  """``run(config, with_grad) -> (jitted fn, inputs)`` for plain calls of
  ``spec``'s shape (features that need extra arrays are tuned without them: tiles
  depend on shape, not on them). Dropout needs none and is kept: its hash can
  dominate a kernel's time."""
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
  if spec.dropout_rate:
    kwargs.update(dropout_rate=spec.dropout_rate, dropout_seed=jnp.int32(0))

  def run(cfg, with_grad):
    f = lambda q, k, v: attention(q, k, v, config=cfg, **kwargs)
    if not with_grad:
      return jax.jit(f), inputs()
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)),
                         argnums=(0, 1, 2)))
    return g, inputs()

  return run
