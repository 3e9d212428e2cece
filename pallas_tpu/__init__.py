"""Pallas Mosaic-TPU kernels. Not implemented yet: every call raises NotImplementedError,
so the frontend moves on to the next platform."""

from __future__ import annotations

NAME = "pallas_tpu"
_REASON = "pallas_tpu: not implemented yet"


def supported(spec) -> str | None:
  """None if this platform can run `spec`, else the reason it cannot."""
  del spec
  return _REASON


def attention_from_operands(ops, spec, config=None):
  del ops, spec, config
  raise NotImplementedError(_REASON)


def flash_attention(q, k, v, **kwargs):
  del q, k, v, kwargs
  raise NotImplementedError(_REASON)
