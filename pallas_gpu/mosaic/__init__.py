"""The Pallas Mosaic-GPU platform (Hopper). Entry: ``mosaic.py``; tiles and their
default: ``config.py``; autotuning: ``autotune.py``; static geometry and the CTA
walks: ``blocks.py``; kernels: ``fwd.py`` (forward), ``bwd.py`` (dQ and dK/dV)
and their memory warpgroup ``pipeline.py``."""

from .config import MosaicConfig, MosaicDkv, MosaicDq, MosaicForward
from .mosaic import (CAPABILITIES, NAME, default_config, flash_attention,
                     resolve_config, supported)
