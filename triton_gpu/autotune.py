"""Autotuning of the triton platform's launches (block sizes, warps, stages) with
the shared persistent cache of common/autotune.py: ``FLASHJAX_AUTOTUNE=1`` tunes
the first call of each (device, shape class) on the GPU; the winner is stored in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/triton.json``) under keys
prefixed ``triton|``, and later calls and processes read it."""

from __future__ import annotations

from ..common import autotune as common
from ..common.launch import KernelsConfig, kernel_configs, kernel_pairs

# Rows: (block_q, block_kv, num_warps, num_stages); backward rows give the dq and
# dkv kernels one row together or one each.
FWD_CANDIDATES = kernel_configs(
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4))
BWD_CANDIDATES = kernel_pairs(
    (64, 64, 4, 2), ((128, 64, 8, 2), (64, 128, 8, 2)), (64, 64, 8, 3))
# D > 128: tiles of 256 columns leave room for narrow tiles only.
WIDE_FWD_CANDIDATES = kernel_configs((64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2))
WIDE_BWD_CANDIDATES = kernel_pairs(
    (32, 32, 4, 1), ((64, 32, 4, 2), (32, 64, 4, 2)), (64, 64, 8, 1))


# ``(forward, backward)`` candidate tables for ``spec``'s head dim.
candidates = common.by_head_dim((FWD_CANDIDATES, BWD_CANDIDATES),
                                (WIDE_FWD_CANDIDATES, WIDE_BWD_CANDIDATES))


TUNER = common.kernel_tuner("triton", KernelsConfig, candidates, key_prefix="triton|")
