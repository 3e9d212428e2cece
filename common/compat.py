"""Shims for the JAX versions we support (0.10.2 on CI, 0.11.2 on the GPU machine).
Every version-dependent call lives here."""

from __future__ import annotations


def transpose_ref(ref, perm):
  """A transposed view of a Mosaic-GPU ref: ``ref.transpose`` in newer JAX,
  ``plgpu.transpose_ref`` (deprecated in 0.11) before."""
  if hasattr(ref, "transpose"):
    try:
      return ref.transpose(perm)
    except (TypeError, NotImplementedError, AttributeError):
      pass
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return plgpu.transpose_ref(ref, perm)
