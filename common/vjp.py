"""One ``custom_vjp`` wrapper for every platform.

A platform supplies ``forward(ops, spec, config) -> (out, lse)`` and
``backward(ops, spec, config, out, lse, do, dlse) -> Operands`` of cotangents
(None where an operand is not differentiable or absent). The static half (spec and
config) travels as one hashable ``nondiff`` argument. Residuals are the operands,
the output and the lse (O(S) memory); they carry checkpoint names so that
``jax.checkpoint`` policies can save or recompute them.
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from . import partition
from .spec import AttentionSpec, Operands

OUT_NAME = "flashjax_out"
LSE_NAME = "flashjax_lse"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, ops: Operands):
  return _run_forward(static, ops)


def _run_forward(static, ops):
  forward, _, spec, config, per_shard = static
  if per_shard:
    return partition.forward(forward, ops, spec, config)
  return forward(ops, spec, config)


def _fwd(static, ops):
  out, lse = _run_forward(static, ops)
  out = checkpoint_name(out, OUT_NAME)
  lse = checkpoint_name(lse, LSE_NAME)
  return (out, lse), (ops, out, lse)


def _bwd(static, res, cotangents):
  _, backward, spec, config, per_shard = static
  ops, out, lse = res
  do, dlse = cotangents
  if per_shard:
    grads = partition.backward(backward, ops, spec, config, out, lse, do, dlse)
  else:
    grads = backward(ops, spec, config, out, lse, do, dlse)
  keep = {"q", "k", "v", "bias", "sinks"}
  return (Operands(*(g if name in keep else None
                     for name, g in zip(Operands._fields, grads))),)


_attention.defvjp(_fwd, _bwd)


def attention(forward, backward, ops: Operands, spec: AttentionSpec, config, *,
              per_shard: bool = False):
  """``(out, lse)`` with the platform's forward, differentiated by its backward.

  ``forward`` and ``backward`` must be module-level functions (hashable, stable)
  so that jit caches hit. ``per_shard`` runs them on each device's batch/head shard
  (common/partition.py): kernel platforms need it, since XLA cannot split their
  custom calls; plain-XLA platforms are split by XLA itself.
  """
  if _capturing:
    raise _Captured((forward, backward, config))
  return _attention((forward, backward, spec, config, per_shard), ops)


_capturing = []


class _Captured(Exception):
  pass


def kernel_parts(call):
  """``(forward, backward, config)`` that ``call()`` (a platform's
  ``attention_from_operands(...)``) would hand to :func:`attention`, after its
  checks and config choice, without running anything: callers that compose the
  forward and backward themselves (common/ring.py) reuse each platform's entry."""
  _capturing.append(True)
  try:
    call()
  except _Captured as e:
    return e.args[0]
  finally:
    _capturing.pop()
  raise RuntimeError("the call did not reach vjp.attention")
