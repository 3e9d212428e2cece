"""The ``triton`` platform: Triton kernels written for flashjax (kernels.py), called
through jax-triton. Default on non-Hopper NVIDIA GPUs.

This module imports neither triton nor jax-triton: ``supported`` reports them
missing with the reason, and the kernels load on the first call. The kernels
cover the whole contract (bias, masks and dropout included).
"""

from __future__ import annotations

import importlib.util

from ..common import platform
from .plan import KernelConfig, KernelsConfig, default_config

NAME = "triton"
CONFIG = KernelsConfig
CAPABILITIES = platform.Capabilities(dtypes=("float32", "bfloat16", "float16"),
                                     max_head_dim=256)

__all__ = ["CAPABILITIES", "CONFIG", "NAME", "KernelConfig", "KernelsConfig",
           "attention_from_operands", "config_from_block_sizes", "default_config",
           "flash_attention", "supported"]


def missing_dependency() -> str | None:
  for module, dist in (("triton", "triton>=3.6"), ("jax_triton", "jax-triton>=0.3.1")):
    if importlib.util.find_spec(module) is None:
      return f"{dist} is not installed (pip install 'flashjax[triton]')"
  return None


def supported(spec) -> str | None:
  """None if this platform can run ``spec``, else the reason it cannot."""
  reason = missing_dependency()
  if reason:
    return reason
  return CAPABILITIES.unsupported(spec)


# jax-flash-attn2's ``blocksize_q``/``blocksize_k``: the forward's tiles.
config_from_block_sizes = platform.block_sizes(default_config, ("fwd",))


def attention_from_operands(ops, spec, config: KernelsConfig | None = None):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  import jax
  from . import autotune
  # Explicit, else cached, else tuned (FLASHJAX_AUTOTUNE=1 on a GPU), else the
  # heuristic default.
  config = autotune.TUNER.resolve(spec, config, attention=flash_attention,
                                  default=default_config(spec),
                                  may_tune=jax.default_backend() == "gpu")
  try:
    from . import attention  # imports triton and jax-triton
  except ImportError as e:  # e.g. jax-triton without a GPU jaxlib
    raise NotImplementedError(f"jax-triton does not import here ({e})") from e
  return attention.attention_from_operands(ops, spec, config)


flash_attention = platform.entry(NAME, attention_from_operands, CAPABILITIES)
