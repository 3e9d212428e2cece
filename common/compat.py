"""Shims for the JAX versions we support (0.10.2 on CI, 0.11.2 on the GPU machine).
Every version-dependent call lives here."""

from __future__ import annotations

import contextlib


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


def without_vma_check():
  """A context that turns off the checking of varying manual axes, as
  ``plgpu.kernel`` does around its own ``pl.kernel`` call: inside
  ``shard_map(check_vma=True)`` a direct ``pl.kernel`` call otherwise rejects
  output types without a manual axis type. ``jax._src.config._check_vma`` in
  0.10 and 0.11."""
  from jax._src import config
  check = getattr(config, "_check_vma", None)
  return check(False) if check is not None else contextlib.nullcontext()


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


def linear_call(fun, fun_transpose, residual_args, linear_args):
  """``jax.custom_derivatives.linear_call``, batchable under ``vmap`` and able to
  carry effects.

  JAX 0.10 registers no batching rule for the ``linear_call`` primitive, so
  ``vmap`` of ``grad`` or of ``jvp`` through it would fail. The rule added here
  (only where JAX has none) vmaps both functions: residuals keep their batch dims,
  linear arguments are broadcast to the batch so the transpose's outputs match
  them, and every output is batched along axis 0.

  Its abstract evaluation also declares no effects, so a transpose whose function
  has some (the ordered io_callbacks of Pallas TPU interpret mode) fails to lower
  for want of their tokens; the abstract evaluation set here passes on the
  called function's effects.
  """
  from jax.custom_derivatives import linear_call as jax_linear_call
  _register_linear_call_rules()
  return jax_linear_call(fun, fun_transpose, residual_args, linear_args)


_LINEAR_CALL_RULES = []


def _register_linear_call_rules():
  if _LINEAR_CALL_RULES:
    return
  _LINEAR_CALL_RULES.append(True)
  try:
    from jax._src.custom_derivatives import linear_call_p
    from jax.interpreters import batching
    batchers = batching.fancy_primitive_batchers
  except (ImportError, AttributeError):
    return  # a JAX without these internals: vmap then fails in JAX's own words
  if linear_call_p not in batchers:
    batchers[linear_call_p] = _batch_linear_call
  linear_call_p.def_effectful_abstract_eval(
      lambda *args, callee, **params: (callee.out_avals, callee.effects))


def _batch_linear_call(axis_data, args, dims, *, callee, transpose_thunk,
                       num_callee_consts, num_res):
  import jax
  import jax.numpy as jnp
  from jax.custom_derivatives import linear_call as jax_linear_call
  from jax.extend.core import jaxpr_as_fun

  size = axis_data.size
  n_res = num_callee_consts + num_res  # the callee's constants, then residuals
  res, lin = list(args[:n_res]), list(args[n_res:])
  res_axes = tuple(dims[:n_res])  # None: not batched
  lin = [jnp.broadcast_to(x, (size,) + x.shape) if d is None
         else jnp.moveaxis(x, d, 0) for x, d in zip(lin, dims[n_res:])]

  def fun(res, lin):
    return jax.vmap(jaxpr_as_fun(callee), in_axes=res_axes + (0,) * len(lin))(
        *res, *lin)

  def fun_transpose(res, cts):
    # The transpose takes the residuals without the callee's constants.
    t_jaxpr, t_consts = transpose_thunk()
    call = lambda *a: jaxpr_as_fun(t_jaxpr)(*t_consts, *a)
    return list(jax.vmap(call, in_axes=res_axes[num_callee_consts:] + (0,) * len(cts))(
        *res[num_callee_consts:], *cts))

  outs = jax_linear_call(fun, fun_transpose, res, lin)
  return outs, [0] * len(outs)


@contextlib.contextmanager
def enable_x64():
  """``jax_enable_x64`` on inside the block (``jax.enable_x64`` where it exists,
  else the config flag), restored after."""
  import jax
  if hasattr(jax, "enable_x64"):
    with jax.enable_x64(True):
      yield
    return
  old = jax.config.read("jax_enable_x64")
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", old)
