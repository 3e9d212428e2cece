"""Pallas Mosaic-TPU flash attention: forward and backward kernels with the whole
contract. Verified in Pallas TPU interpret mode on CPU only (no TPU available)."""

from .attention import (CAPABILITIES, NAME, attention_from_operands, count_kv_steps,
                        flash_attention, supported)
from .config import BlockSizes, TpuConfig, config_from_block_sizes, default_config
from .kvcache import KvCacheConfig, kvcache_attention, kvcache_supported

CONFIG = TpuConfig
