"""Autotuning of the Mosaic-GPU tiles, with a persistent cache (common/autotune.py).

With ``FLASHJAX_AUTOTUNE=1`` (or :func:`tune` called directly) on a GPU, the first
call of a shape class times the forward candidates (K/V block and pipeline depth
for the head dim, crossed with the launch kind and the split tail) on random
inputs of that shape, then the backward candidates (dQ and dK/dV tiles and
pipeline depths, one launch or two) with the winning forward, and stores the
winner in a JSON cache keyed by device kind and shape class. The default config
competes in both rounds, so tuning never picks worse than the default as timed.
Later calls, in this process or another, read the cache. The cache lives in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/pallas_mosaic_gpu.json``;
keys start with ``mosaic|``, so the file can be shared with the other platforms).

Only the Mosaic fields are tuned and cached; where the Pallas-Triton backward
runs (D = 256), its tiles are resolved by that platform's own tuning.
"""

from __future__ import annotations

import dataclasses

from ..common import autotune as common
from . import mosaic_config

# Forward K/V tiles per padded head dim: what fits beside two 64-row q blocks in
# shared memory (D = 256 leaves room for 64-key blocks in two stages only).
FORWARD = {
    64: (dict(block_kv=128, num_stages=3), dict(block_kv=128, num_stages=2),
         dict(block_kv=64, num_stages=3), dict(block_kv=64, num_stages=4)),
    128: (dict(block_kv=128, num_stages=2), dict(block_kv=64, num_stages=3),
          dict(block_kv=64, num_stages=4), dict(block_kv=64, num_stages=2)),
    256: (dict(block_kv=64, num_stages=2),),
}
# The split tail applies to persistent full-band launches only (mosaic_blocks).
LAUNCH = (dict(persistent=None), dict(persistent=True), dict(persistent=False),
          dict(persistent=True, split_tail=True), dict(persistent=True, split_tail=False))
# Backward variants of the forward winner: (kernel, fields), kernel "" for the
# config's own fields.
BACKWARD = (("", dict()), ("dq", dict(block_kv=128)), ("dq", dict(num_stages=3)),
            ("dkv", dict(num_stages=3)), ("dkv", dict(block_q=128)),
            ("", dict(bwd_one_launch=False)))


CACHE = common.JsonCache("pallas_mosaic_gpu", mosaic_config.to_json,
                         mosaic_config.from_json, key_prefix="mosaic|")


def lookup(spec) -> mosaic_config.MosaicConfig | None:
  return CACHE.lookup(spec)


def _unique(configs):
  out = []
  for c in configs:
    if c not in out:
      out.append(c)
  return out


def candidates(spec, base: mosaic_config.MosaicConfig):
  """``(forward, backward)`` candidate builders for ``spec``: forward configs
  (``base`` first), and ``f(forward winner) -> backward configs`` (empty where the
  Mosaic backward does not run)."""
  d = mosaic_config.padded_head_dim(spec)
  fwd = _unique([base] + [dataclasses.replace(base, fwd=dataclasses.replace(
      base.fwd, **tiles, **launch)) for tiles in FORWARD[d] for launch in LAUNCH])

  def vary(cfg, kernel, fields):
    if not kernel:
      return dataclasses.replace(cfg, **fields)
    return dataclasses.replace(cfg, **{kernel: dataclasses.replace(
        getattr(cfg, kernel), **fields)})

  def bwd(winner):
    if not mosaic_config.uses_mosaic_backward(spec, winner):
      return []
    return _unique([vary(winner, kernel, fields) for kernel, fields in BACKWARD])

  return fwd, bwd


def tune(spec, run, *, timer=common.default_timer,
         base: mosaic_config.MosaicConfig | None = None) -> mosaic_config.MosaicConfig:
  """Times the candidates for ``spec`` (``run(config, with_grad) -> (fn, args)``)
  and caches the winner; candidates that fail to compile are skipped."""
  base = base or mosaic_config.default_config(spec)

  def go():
    fwd, bwd = candidates(spec, base)
    cfg = common.fastest(fwd, run, False, timer, CACHE.platform)
    backward = bwd(cfg)
    if backward:
      cfg = common.fastest(backward, run, True, timer, CACHE.platform)
    CACHE.store(spec, cfg)
    return cfg

  return common.in_fresh_thread(go)
