"""Blockwise online-softmax attention in plain JAX/XLA: the whole contract, on every
backend (the default on CPU and the universal fallback)."""

from .attention import (CAPABILITIES, NAME, attention_from_operands, flash_attention,
                        supported)
from .config import BlockSizes, XlaConfig, config_from_block_sizes, default_config

CONFIG = XlaConfig
