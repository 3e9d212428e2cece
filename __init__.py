"""flashjax: exact flash attention for JAX on every backend.

One contract (``flash_attention``), the seeds' entry points
(``get_cached_flash_attention``, ``flash_mha``, ``flash_mha_varlen``), kernels per
platform chosen automatically. Importing this package needs only jax: platform
subpackages (and triton) are imported when first used.
"""

__version__ = "0.1.0"

from .api import flash_attention
from .compat.flash_attn_jax import flash_mha, flash_mha_varlen
from .compat.jax_flash_attn2 import get_cached_flash_attention
from .common.spec import FEATURES, AttentionSpec
from .compat.jax_nn import dot_product_attention
from .inference import flash_mha_with_kvcache
from .ring import ring_attention, zigzag_order, zigzag_restore

__all__ = ["flash_attention", "dot_product_attention", "flash_mha", "flash_mha_varlen",
           "flash_mha_with_kvcache", "get_cached_flash_attention", "ring_attention",
           "zigzag_order", "zigzag_restore", "AttentionSpec", "FEATURES"]
