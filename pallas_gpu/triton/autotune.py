"""Autotuning of the Pallas-Triton tiles, with a persistent cache
(common/autotune.py).

With ``FLASHJAX_AUTOTUNE=1`` (or ``TUNER.tune`` called directly), the first call of a
shape class times each candidate forward config on random inputs of that shape,
then each backward candidate with the winning forward, and stores the winners in a
JSON cache keyed by device kind and shape class. Later calls, in this process or
another, read the cache without timing. The cache lives in
``$FLASHJAX_AUTOTUNE_CACHE`` (default ``~/.cache/flashjax/pallas_triton.json``).
"""

from __future__ import annotations

from ...common import autotune as common
from ...common.launch import kernel_configs, kernel_pairs
from .plan import TritonConfig

# Rows: (block_q, block_kv, num_warps, num_stages); backward rows give the dq and
# dkv kernels one row together or one each.
FWD_CANDIDATES = kernel_configs(
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
    (128, 64, 4, 2), (128, 64, 8, 4), (64, 64, 4, 3))
BWD_CANDIDATES = kernel_pairs(
    (64, 64, 4, 2), (64, 128, 8, 2), ((128, 64, 8, 2), (64, 128, 8, 2)))
# D > 128: q/k/v/do tiles of 256 columns leave room for narrow tiles only.
WIDE_FWD_CANDIDATES = kernel_configs(
    (64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 3))
WIDE_BWD_CANDIDATES = kernel_pairs(
    (32, 32, 4, 1), ((64, 32, 4, 2), (32, 64, 4, 2)), ((64, 32, 8, 2), (32, 64, 8, 2)),
    (64, 64, 8, 1), ((128, 32, 8, 1), (32, 128, 8, 1)))


# ``(forward, backward)`` candidate tables for ``spec``'s head dim.
candidates = common.by_head_dim((FWD_CANDIDATES, BWD_CANDIDATES),
                                (WIDE_FWD_CANDIDATES, WIDE_BWD_CANDIDATES))


TUNER = common.kernel_tuner("pallas_triton", TritonConfig, candidates)
