"""Blockwise online-softmax attention in plain JAX/XLA. Not implemented yet: every call raises NotImplementedError,
so the frontend moves on to the next platform."""

from __future__ import annotations

NAME = "xla_cpu"
_REASON = "xla_cpu: not implemented yet"


def supported(spec) -> str | None:
  """None if this platform can run `spec`, else the reason it cannot."""
  del spec
  return _REASON


def flash_attention(q, k, v, **kwargs):
  del q, k, v, kwargs
  raise NotImplementedError(_REASON)
