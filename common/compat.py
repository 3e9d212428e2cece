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


def mgpu_load(ref, layout):
  """``plgpu.load`` of a whole (already indexed) ref into ``layout``: 0.10 takes
  the index positionally; 0.11 deprecates passing it (index via ``ref.at``)."""
  import inspect

  import jax.experimental.pallas.mosaic_gpu as plgpu
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def varying_axes(x) -> frozenset:
  """Manual mesh axes along which ``x`` varies inside ``shard_map`` (empty outside
  it, or where the checking of varying axes is off): ``.manual_axis_type.varying``
  of the type in 0.10, ``.vma`` in other versions."""
  import jax
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def vary_like(x, *refs):
  """``x`` marked as varying along every axis that any of ``refs`` varies along
  (scan carries and switch branches must agree on it)."""
  import jax
  axes = frozenset().union(*(varying_axes(r) for r in refs)) - varying_axes(x)
  if not axes:
    return x
  axes = tuple(sorted(axes))
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)
