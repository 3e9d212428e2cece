"""Entry point of the xla_cpu platform."""

from __future__ import annotations

from ..common import spec as spec_lib
from ..common import vjp
from .backward import backward
from .config import XlaConfig, default_config
from .forward import forward


def supported(spec: spec_lib.AttentionSpec) -> str | None:
  """Every feature, dtype and head dim of the contract runs here."""
  del spec
  return None


def attention_from_operands(ops, spec, config: XlaConfig | None = None):
  """``(out, lse)`` for canonical operands (the frontend's entry)."""
  config = config or default_config(spec)
  if not isinstance(config, XlaConfig):
    raise ValueError(f"config must be an XlaConfig, got {type(config).__name__}")
  return vjp.attention(forward, backward, ops, spec, config)


def flash_attention(q, k, v, *, config: XlaConfig | None = None, **kwargs):
  """Blockwise exact attention in plain JAX; the contract of docs/DESIGN.md.

  Args:
    q, k, v: ``[B, Sq, Hq, D]``, ``[B, Sk, Hkv, D]``, ``[B, Sk, Hkv, Dv]``.
    config: block sizes (``XlaConfig``); default from ``default_config``.
    **kwargs: bias, mask, causal, sliding_window, segment_ids, softmax_scale,
      logits_soft_cap, sinks, dropout_rate, dropout_seed, return_lse.

  Returns:
    ``out [B, Sq, Hq, Dv]`` in q's dtype, or ``(out, lse [B, Hq, Sq])``.
  """
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  out, lse = attention_from_operands(ops, spec, config)
  return (out, lse) if spec.return_lse else out
