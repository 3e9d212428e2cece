"""Entry point of the Pallas Mosaic-TPU platform."""

from __future__ import annotations

import jax
import jax.custom_batching
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import spec as spec_lib
from ..common import epilogue, platform, vjp
from . import backward as bwd_lib
from . import forward as fwd_lib
from .config import TpuConfig, default_config
from .plan import make_plan, prepare

NAME = "pallas-tpu"
# The whole contract; D <= 256: q/k/v tiles and the fp32 accumulator must fit VMEM.
CAPABILITIES = platform.Capabilities(dtypes=("float32", "bfloat16", "float16"),
                                     max_head_dim=256, interpret=True)


def _interpret_params(static: platform.Static):
  # Simulates TPU memory spaces and DMA; uninitialised memory reads as NaN, so an
  # unwritten output block fails the tests.
  return pltpu.InterpretParams() if static.interpret else None


def supported(spec: spec_lib.AttentionSpec) -> str | None:
  return CAPABILITIES.unsupported(spec)


def _vmapped_in_sequence(fn, static: platform.Static, arrays):
  """``fn(arrays)`` for a pytree of arrays; in interpret mode a ``vmap`` of it runs
  the mapped axis one element after another (``lax.map``). Pallas' batching rule
  adds a grid axis but not its dimension semantics, which the TPU interpreter
  zips with the grid (JAX 0.10.2: ``safe_zip() argument 1 has length 4 but
  argument 0 has length 5``)."""
  if not static.interpret:
    return fn(arrays)
  leaves, tree = jax.tree.flatten(arrays)

  @jax.custom_batching.custom_vmap
  def call(*leaves):
    return fn(jax.tree.unflatten(tree, leaves))

  @call.def_vmap
  def _rule(axis_size, in_batched, *leaves):
    del axis_size

    def one(batched):
      it = iter(batched)
      return call(*(next(it) if b else x for x, b in zip(leaves, in_batched)))

    out = jax.lax.map(one, [x for x, b in zip(leaves, in_batched) if b])
    return out, jax.tree.map(lambda _: True, out)

  return call(*leaves)


def forward(ops, spec, static: platform.Static):
  return _vmapped_in_sequence(lambda ops: _forward(ops, spec, static), static, ops)


def _forward(ops, spec, static: platform.Static):
  plan = make_plan(spec, static.config.fwd)
  out, lse = fwd_lib.forward(prepare(ops, plan), plan,
                             interpret=_interpret_params(static))
  return epilogue.finish_forward(jnp.swapaxes(out, 1, 2), lse[..., 0], spec, ops.sinks)


def backward(ops, spec, static: platform.Static, out, lse, do, dlse):
  return _vmapped_in_sequence(lambda a: _backward(a[0], spec, static, *a[1:]),
                              static, (ops, out, lse, do, dlse))


def _backward(ops, spec, static: platform.Static, out, lse, do, dlse):
  plan = make_plan(spec, static.config.bwd)
  x = prepare(ops, plan)
  delta, lse_rows, delta_rows = epilogue.backward_rows(out, do, dlse, lse,
                                                       plan.seq_q_padded)
  do_k = jnp.pad(jnp.swapaxes(do, 1, 2).astype(ops.q.dtype),
                 ((0, 0), (0, 0), (0, plan.seq_q_padded - spec.seq_q), (0, 0)))
  dq, dk, dv, ds = bwd_lib.backward(x, plan, do_k, lse_rows[..., None],
                                    delta_rows[..., None],
                                    interpret=_interpret_params(static))
  dbias = dsinks = None
  if ops.bias is not None:
    dbias = epilogue.dbias_from_ds(ds, spec, ops.bias)
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, delta)
  unpad = lambda a, s: jnp.swapaxes(a[:, :, :s], 1, 2)
  return spec_lib.Operands(q=unpad(dq, spec.seq_q), k=unpad(dk, spec.seq_k),
                           v=unpad(dv, spec.seq_k), bias=dbias, sinks=dsinks)


def _static(spec, config, interpret) -> platform.Static:
  if not interpret and jax.default_backend() != "tpu":
    raise NotImplementedError("needs a TPU, or interpret=True on CPU")
  config = platform.check_config(config or default_config(spec), TpuConfig, NAME)
  return platform.Static(config=config, interpret=bool(interpret))


def _check_interpret_on_one_device(ops):
  """Interpret mode needs the whole call on one device. Under jit on a host with
  several devices the inputs may be sharded (a tracer does not say), and XLA then
  runs the interpreter's callbacks on one device while the others wait in a
  collective: the process aborts after 40 s (``Termination timeout for all
  reduce``, measured with 4 CPU devices, JAX 0.10.2). So that case raises."""
  n = jax.device_count()
  if n == 1:
    return
  for x in jax.tree.leaves(ops):
    traced = isinstance(x, jax.core.Tracer)
    sharding = None if traced else getattr(x, "sharding", None)  # numpy: none
    if traced or sharding is not None and len(sharding.device_set) > 1:
      raise NotImplementedError(
          f"interpret mode runs on one device; with {n} devices "
          + ("under jit the inputs may be sharded" if traced else
             "the inputs are sharded") + ", and XLA would run the interpreter's "
          "callbacks on one device while the others wait (a deadlock). Run it with "
          "one device or on unsharded arrays outside jit, or use platform='xla' "
          "(or 'pallas-triton' with interpret=True), which split sharded inputs")


def attention_from_operands(ops, spec, config: TpuConfig | None = None,
                            interpret: bool = False):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  static = _static(spec, config, interpret)
  if static.interpret:
    _check_interpret_on_one_device(ops)
  # TPU interpret mode runs on ordered io_callbacks, which a custom_partitioning
  # lowering cannot hold: interpreted calls are not split per shard.
  return vjp.attention(forward, backward, ops, spec, static,
                       per_shard=not static.interpret)


flash_attention = platform.entry(NAME, attention_from_operands, CAPABILITIES)


def count_kv_steps(q, k, v, *, config: TpuConfig | None = None, **kwargs) -> int:
  """Executed (non-skipped) kv steps of the forward kernel, summed over the grid,
  counted inside the kernel in interpret mode (for tests of block skipping)."""
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  static = _static(spec, config, True)
  plan = make_plan(spec, static.config.fwd)
  _, _, count = fwd_lib.forward(prepare(ops, plan), plan,
                                interpret=_interpret_params(static), count=True)
  return int(count.sum())
