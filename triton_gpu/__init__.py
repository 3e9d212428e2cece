"""The ``triton`` platform: Triton kernels written for flashjax (kernels.py), called
through jax-triton. Default on non-Hopper NVIDIA GPUs.

This module imports neither triton nor jax-triton: ``supported`` reports them
missing with the reason, and the kernels load on the first call. The kernels
cover the whole contract (bias, masks and dropout included).
"""

from __future__ import annotations

import importlib.util

from ..common import spec as spec_lib
from ..common.launch import with_forward_blocks
from .plan import Launch, TritonKernelsConfig, default_config

NAME = "triton_gpu"
DTYPES = ("float32", "bfloat16", "float16")
MAX_HEAD_DIM = 256

__all__ = ["Launch", "TritonKernelsConfig", "attention_from_operands",
           "config_from_block_sizes", "default_config", "flash_attention", "supported"]


def missing_dependency() -> str | None:
  for module, dist in (("triton", "triton>=3.6"), ("jax_triton", "jax-triton>=0.3.1")):
    if importlib.util.find_spec(module) is None:
      return f"triton: {dist} is not installed (pip install 'flashjax[triton]')"
  return None


def supported(spec) -> str | None:
  """None if this platform can run ``spec``, else the reason it cannot."""
  reason = missing_dependency()
  if reason:
    return reason
  reason = spec_lib.unsupported_dtype_or_head_dim(spec, "triton", DTYPES, MAX_HEAD_DIM)
  if reason:
    return reason
  return None


def config_from_block_sizes(spec, block_q=None, block_kv=None) -> TritonKernelsConfig:
  """jax-flash-attn2's ``blocksize_q``/``blocksize_k`` over the default (forward)."""
  return with_forward_blocks(default_config(spec), block_q, block_kv)


def attention_from_operands(ops, spec, config: TritonKernelsConfig | None = None):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  import jax
  from . import autotune
  config = autotune.resolve_config(spec, config, flash_attention,
                                   on_gpu=jax.default_backend() == "gpu")
  try:
    from . import attention  # imports triton and jax-triton
  except ImportError as e:  # e.g. jax-triton without a GPU jaxlib
    raise NotImplementedError(f"triton: jax-triton does not import here ({e})") from e
  return attention.attention_from_operands(ops, spec, config)


def flash_attention(q, k, v, *, config: TritonKernelsConfig | None = None, **kwargs):
  """Triton flash attention through jax-triton; the contract of docs/DESIGN.md."""
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  out, lse = attention_from_operands(ops, spec, config)
  return (out, lse) if spec.return_lse else out
