"""One differentiation wrapper for every platform: reverse mode by the platform's
backward, forward mode by the common blockwise tangent.

A platform supplies ``forward(ops, spec, static) -> (out, lse)`` and
``backward(ops, spec, static, out, lse, do, dlse) -> Operands`` of cotangents
(None where an operand is not differentiable or absent); ``static`` is the
platform's hashable static half (``platform.Static(config, interpret)`` on the
kernel platforms, the config itself on xla). Spec and static travel as one
hashable ``nondiff`` argument.

The function is a ``jax.custom_jvp``. Its tangent is a ``linear_call`` of the
forward-mode tangent (``common/tangent.py``) whose declared transpose is the
platform's backward, so ``jax.jvp`` / ``jax.jacfwd`` run the tangent and
``jax.grad`` / ``jax.vjp`` transpose straight to the backward kernels, never
through a transposed tangent. Residuals are the operands, the output and the lse
(O(S) memory); they carry checkpoint names so that ``jax.checkpoint`` policies can
save or recompute them.

Second-order derivatives (a derivative of anything computed inside the rule) raise
one :class:`SecondOrderError` (a ``NotImplementedError``) that says what is
supported.
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from . import compat, partition
from .platform import traced_once
from .spec import AttentionSpec, Operands
from .tangent import attention_tangent

OUT_NAME = "flashjax_out"
LSE_NAME = "flashjax_lse"
DIFFERENTIABLE = ("q", "k", "v", "bias", "sinks")


class SecondOrderError(NotImplementedError):
  """A derivative of a derivative of flashjax attention was asked for."""


SECOND_ORDER_ERROR = (
    "flashjax attention is differentiable to first order only: jax.grad, jax.vjp, "
    "jax.jacrev (the platform's backward kernels) and jax.jvp, jax.linearize, "
    "jax.jacfwd (the blockwise tangent). Second-order derivatives (jax.grad of a "
    "gradient, jax.hessian, Hessian-vector products as jvp of grad or grad of jvp, "
    "jvp of jvp) are not supported; differentiate "
    "flashjax.common.reference.attention (dense, O(S^2) memory) for those.")


def _first_order_only(fn):
  """``fn(static, *args)`` whose differentiation raises the second-order error.

  Everything inside the jvp rule runs on primal values: a transformation that
  differentiates it is a derivative of a derivative.
  """

  @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
  def call(static, *args):
    return fn(static, *args)

  @call.defjvp
  def _jvp(static, primals, tangents):
    del static, primals, tangents
    raise SecondOrderError(SECOND_ORDER_ERROR)

  return call


def _run_forward(static, ops):
  forward, _, spec, config, per_shard = static
  forward = traced_once(forward)
  if per_shard:
    return partition.forward(forward, ops, spec, config)
  return forward(ops, spec, config)


def _run_backward(static, ops, out, lse, do, dlse):
  _, backward, spec, config, per_shard = static
  backward = traced_once(backward)
  if per_shard:
    return partition.backward(backward, ops, spec, config, out, lse, do, dlse)
  return backward(ops, spec, config, out, lse, do, dlse)


_forward_once = _first_order_only(_run_forward)
_backward_once = _first_order_only(_run_backward)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _attention(static, ops: Operands):
  return _run_forward(static, ops)


def _linear(t_ops: Operands) -> tuple:
  """The tangents of q, k, v, bias and sinks; None for absent operands and for
  symbolic zeros, so that transposition sees only the tangents in play."""
  return tuple(None if isinstance(t, SymbolicZero) else t
               for t in (getattr(t_ops, n) for n in DIFFERENTIABLE))


def _jvp(static, primals, tangents):
  (ops,), (t_ops,) = primals, tangents
  out, lse = _forward_once(static, ops)
  out = checkpoint_name(out, OUT_NAME)
  lse = checkpoint_name(lse, LSE_NAME)
  spec = static[2]
  lin = _linear(t_ops)

  def tangent(res, lin):
    ops, out, lse = res
    return attention_tangent(ops, Operands(**dict(zip(DIFFERENTIABLE, lin))), spec,
                             out, lse)

  def transpose(res, cotangents):
    ops, out, lse = res
    do, dlse = cotangents
    grads = _backward_once(static, ops, out, lse, do, dlse)
    return tuple(None if t is None else getattr(grads, n)
                 for n, t in zip(DIFFERENTIABLE, lin))

  t_out, t_lse = compat.linear_call(tangent, transpose, (ops, out, lse), lin)
  return (out, lse), (t_out, t_lse)


_attention.defjvp(_jvp, symbolic_zeros=True)


def attention(forward, backward, ops: Operands, spec: AttentionSpec, config, *,
              per_shard: bool = False):
  """``(out, lse)`` with the platform's forward, differentiable in both modes.

  ``forward`` and ``backward`` must be module-level functions (hashable, stable)
  so that jit caches hit. ``per_shard`` runs them on each device's shard
  (common/partition.py): kernel platforms need it, since XLA cannot split their
  custom calls; the xla platform, for the ring on a split sequence.
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
