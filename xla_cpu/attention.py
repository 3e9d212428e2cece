"""Entry point of the xla_cpu platform."""

from __future__ import annotations

from ..common import spec as spec_lib
from ..common import platform, vjp
from .backward import backward
from .config import XlaConfig, default_config
from .forward import forward

NAME = "xla"
# The whole contract, every float dtype (fp64 too) and head dim.
CAPABILITIES = platform.Capabilities(dtypes=spec_lib.FLOAT_DTYPES)


def supported(spec: spec_lib.AttentionSpec) -> str | None:
  return CAPABILITIES.unsupported(spec)


def attention_from_operands(ops, spec, config: XlaConfig | None = None):
  """``(out, lse)`` for canonical operands (the frontend's entry)."""
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  config = platform.check_config(config or default_config(spec), XlaConfig, NAME)
  # Per shard like the kernel platforms (common/partition.py): XLA's own
  # partitioner splits batch and heads as well, but gathers K/V of a sequence
  # split by an Auto mesh axis; the partition callback runs the ring instead.
  # One device: the call is the plain forward/backward (partition.enabled).
  return vjp.attention(forward, backward, ops, spec, config, per_shard=True)


flash_attention = platform.entry(NAME, attention_from_operands, CAPABILITIES)
