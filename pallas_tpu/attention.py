"""Entry point of the Pallas Mosaic-TPU platform."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ..common import spec as spec_lib
from ..common import epilogue, vjp
from . import backward as bwd_lib
from . import forward as fwd_lib
from .config import TpuConfig, default_config
from .plan import make_plan, prepare

DTYPES = ("float32", "bfloat16", "float16")
MAX_HEAD_DIM = 256  # q/k/v tiles and the fp32 accumulator must fit VMEM


@dataclasses.dataclass(frozen=True)
class _Static:
  config: TpuConfig
  interpret: bool

  @property
  def interpret_params(self):
    # Simulates TPU memory spaces and DMA; uninitialised memory reads as NaN, so
    # an unwritten output block fails the tests.
    return pltpu.InterpretParams() if self.interpret else None


def supported(spec: spec_lib.AttentionSpec) -> str | None:
  return spec_lib.unsupported_dtype_or_head_dim(spec, "pallas-tpu", DTYPES, MAX_HEAD_DIM)


def forward(ops, spec, static: _Static):
  plan = make_plan(spec, static.config.fwd)
  out, lse = fwd_lib.forward(prepare(ops, plan), plan,
                             interpret=static.interpret_params)
  return epilogue.finish_forward(jnp.swapaxes(out, 1, 2), lse[..., 0], spec, ops.sinks)


def backward(ops, spec, static: _Static, out, lse, do, dlse):
  plan = make_plan(spec, static.config.bwd)
  x = prepare(ops, plan)
  delta, lse_rows, delta_rows = epilogue.backward_rows(out, do, dlse, lse,
                                                       plan.seq_q_padded)
  do_k = jnp.pad(jnp.swapaxes(do, 1, 2).astype(ops.q.dtype),
                 ((0, 0), (0, 0), (0, plan.seq_q_padded - spec.seq_q), (0, 0)))
  dq, dk, dv, ds = bwd_lib.backward(x, plan, do_k, lse_rows[..., None],
                                    delta_rows[..., None],
                                    interpret=static.interpret_params)
  dbias = dsinks = None
  if ops.bias is not None:
    dbias = epilogue.dbias_from_ds(ds, spec, ops.bias)
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, delta)
  unpad = lambda a, s: jnp.swapaxes(a[:, :, :s], 1, 2)
  return spec_lib.Operands(q=unpad(dq, spec.seq_q), k=unpad(dk, spec.seq_k),
                           v=unpad(dv, spec.seq_k), bias=dbias, sinks=dsinks)


def _static(spec, config, interpret) -> _Static:
  if not interpret and jax.default_backend() != "tpu":
    raise NotImplementedError("pallas-tpu: needs a TPU, or interpret=True on CPU")
  config = config or default_config(spec)
  if not isinstance(config, TpuConfig):
    raise ValueError(f"config must be a pallas_tpu.TpuConfig, got "
                     f"{type(config).__name__}")
  return _Static(config=config, interpret=bool(interpret))


def attention_from_operands(ops, spec, config: TpuConfig | None = None,
                            interpret: bool = False):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  static = _static(spec, config, interpret)
  # TPU interpret mode runs on ordered io_callbacks, which a custom_partitioning
  # lowering cannot hold: interpreted calls leave sharded inputs to XLA (gathered).
  return vjp.attention(forward, backward, ops, spec, static,
                       per_shard=not static.interpret)


def flash_attention(q, k, v, *, config: TpuConfig | None = None,
                    interpret: bool = False, **kwargs):
  """Pallas Mosaic-TPU flash attention; the contract of docs/DESIGN.md.

  ``interpret=True`` runs the kernels in Pallas TPU interpret mode (any backend),
  which is how this project verifies them: no TPU was available.
  """
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  out, lse = attention_from_operands(ops, spec, config, interpret)
  return (out, lse) if spec.return_lse else out


def count_kv_steps(q, k, v, *, config: TpuConfig | None = None, **kwargs) -> int:
  """Executed (non-skipped) kv steps of the forward kernel, summed over the grid,
  counted inside the kernel in interpret mode (for tests of block skipping)."""
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  static = _static(spec, config, True)
  plan = make_plan(spec, static.config.fwd)
  _, _, count = fwd_lib.forward(prepare(ops, plan), plan,
                                interpret=static.interpret_params, count=True)
  return int(count.sum())
