"""The Pallas-Triton platform (Pallas lowered through Triton; any CUDA GPU, and
interpret mode on the CPU). Entry: ``pallas_triton.py``; configs, geometry and the
in-kernel tile math: ``plan.py``; autotuning: ``autotune.py``; kernels:
``fwd.py``, ``bwd.py``, the split-KV decode forward ``decode.py`` and its KV-cache
form ``kvcache.py``."""

from .decode import DecodeConfig
from .pallas_triton import (CAPABILITIES, NAME, default_config, flash_attention,
                            resolve_config, supported)
from .plan import KernelConfig, TritonConfig, TritonForward
