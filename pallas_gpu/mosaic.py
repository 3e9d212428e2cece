"""Mosaic-GPU kernels for Hopper (wgmma, TMA, warp specialisation). Not implemented yet: every call raises NotImplementedError, so the
frontend moves on to the next platform."""

from __future__ import annotations

_REASON = "not implemented yet"


def supported(spec) -> str | None:
  """None if this platform can run `spec`, else the reason it cannot."""
  del spec
  return _REASON


def attention_from_operands(ops, spec, config=None):
  del ops, spec, config
  raise NotImplementedError(f"pallas_gpu.mosaic: {_REASON}")


def flash_attention(q, k, v, **kwargs):
  del q, k, v, kwargs
  raise NotImplementedError(f"pallas_gpu.mosaic: {_REASON}")
