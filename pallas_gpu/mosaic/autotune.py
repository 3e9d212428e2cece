"""Autotuning of the Mosaic-GPU tiles, with a persistent cache (common/autotune.py).

With ``FLASHJAX_AUTOTUNE=1`` (or ``TUNER.tune`` called directly) on a GPU, the first
call of a shape class times the forward candidates (K/V block and pipeline depth
for the head dim, crossed with the launch kind and the split tail) on random
inputs of that shape, then the backward candidates (dQ and dK/dV tiles and
pipeline depths, one launch or two; the single pass or the two kernels where
the single pass applies) with the winning forward, and stores the
winner in a JSON cache keyed by device kind and shape class. The default config
competes in both rounds, so tuning never picks worse than the default as timed.
Later calls, in this process or another, read the cache. The cache lives in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/pallas_mosaic_gpu.json``;
keys start with ``mosaic|``, so the file can be shared with the other platforms).

Only the Mosaic fields are tuned and cached; where the Pallas-Triton backward
runs (an fp32 bias), its tiles are resolved by that platform's own tuning.
"""

from __future__ import annotations

import dataclasses
import functools

from ...common import autotune as common
from ...common import configs
from .config import (MosaicConfig, fixed_backward_tiles, from_json, padded_head_dim,
                     single_pass_applies, to_json, uses_mosaic_backward)

# Forward K/V tiles per padded head dim: what fits beside two 64-row q blocks in
# shared memory (D = 256 leaves room for 64-key blocks in two stages only).
FORWARD = {
    64: (dict(block_kv=128, num_stages=3), dict(block_kv=128, num_stages=2),
         dict(block_kv=64, num_stages=3), dict(block_kv=64, num_stages=4)),
    128: (dict(block_kv=128, num_stages=2), dict(block_kv=64, num_stages=3),
          dict(block_kv=64, num_stages=4), dict(block_kv=64, num_stages=2)),
    256: (dict(block_kv=64, num_stages=2),),
}
# The split tail applies to persistent full-band launches without segment ids
# only (blocks.py, mosaic.geometry).
LAUNCH = (dict(persistent=None), dict(persistent=True), dict(persistent=False),
          dict(persistent=True, split_tail=True), dict(persistent=True, split_tail=False),
          dict(persistent=True, balanced=False))
# Backward variants of the forward winner: (kernel, fields), "launch" for the
# other of one launch and two.
BACKWARD = (("dq", dict(block_kv=128)), ("dq", dict(num_stages=3)),
            ("dkv", dict(num_stages=3)), ("dkv", dict(block_q=128)),
            ("launch", {}))
# Above D = 128 or with an additive tile the default tiles fill shared memory
# (config.fixed_backward_tiles): only the launch varies.
BACKWARD_FIXED = (("launch", {}),)


CACHE = common.JsonCache("pallas_mosaic_gpu", to_json,
                         from_json, key_prefix="mosaic|")


def forward_candidates(spec, best: MosaicConfig):
  """``best`` with its forward's tiles and launch varied."""
  d = padded_head_dim(spec)
  return [configs.with_part(best, "fwd", **tiles, **launch)
          for tiles in FORWARD[d] for launch in LAUNCH]


def backward_candidates(spec, best: MosaicConfig):
  """``best`` (the forward winner) with its backward kernels varied; none where
  the Mosaic backward does not run. The tiles and the launch vary the two
  kernels (with the single pass off: it takes the default dK/dV tiles and has
  no dQ kernel); where the single pass applies, the other of it and the two
  kernels competes too."""
  if not uses_mosaic_backward(spec, best):
    return []
  two = dataclasses.replace(best, bwd_single_pass=False)

  def vary(kernel, fields):
    if kernel == "launch":
      return dataclasses.replace(two, bwd_one_launch=not two.bwd_one_launch)
    return configs.with_part(two, kernel, **fields)

  fixed = fixed_backward_tiles(spec) is not None
  out = [vary(kernel, fields) for kernel, fields in (BACKWARD_FIXED if fixed else BACKWARD)]
  if single_pass_applies(spec, best) is None:
    out.append(dataclasses.replace(best, bwd_single_pass=not best.bwd_single_pass))
  return out


TUNER = common.Tuner(CACHE, lambda spec: (
    common.Round(False, functools.partial(forward_candidates, spec)),
    common.Round(True, functools.partial(backward_candidates, spec))))
