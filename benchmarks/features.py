"""Feature shapes (``Shape.dropout_rate``, ``Shape.mask``, ``Shape.bias``): each
flashjax implementation with the feature and without it, side by side in
interleaved rounds, so the feature's cost is a ratio of one run.

For a feature shape every flashjax implementation of the CLI becomes:

* ``<name>``: the call with the feature, checked against the reference with
  the same feature:
  - dropout: ``dropout_rate`` and a fixed seed (one hash on every platform);
  - mask: a dense ``[B, 1, Sq, Sk]`` boolean mask keeping a random 90% (with
    the causal band where the shape is causal);
  - bias: a ``[1, H, Sq, Sk]`` bias in the inputs' dtype, broadcast over the
    batch and differentiated (the forward+backward computes dbias, as a
    trained relative-position bias does);
* ``<name>[no <feature>]``: the same call without it.

The mask and bias are arguments of the timed programs (:class:`WithFeature`),
not constants XLA could fold. Peers have no call of this contract; their rows
say so.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from flashjax.common.shapes import Shape

from . import impls

SEED = 1234
# The share of keys a benchmark mask keeps.
MASK_KEPT = 0.9


def feature(shape: Shape) -> str | None:
  """The shape's feature: "dropout", "mask", "bias" or None."""
  if shape.dropout_rate:
    return "dropout"
  if shape.mask:
    return "mask"
  if shape.bias:
    return "bias"
  return None


def without(shape: Shape) -> str:
  """The suffix of the variant without the shape's feature."""
  return f"[no {feature(shape)}]"


def operands(shape: Shape, q, k) -> tuple:
  """The mask or bias of a call on ``q [B, Sq, H, D]`` and ``k [B, Sk, Hkv,
  D]`` (random, fixed by ``SEED`` and the sizes); ``()`` for other shapes."""
  b, sq, h = q.shape[:3]
  sk = k.shape[1]
  key = jax.random.key(SEED)
  if shape.mask:
    return (jax.random.bernoulli(key, MASK_KEPT, (b, 1, sq, sk)),)
  if shape.bias:
    return (jax.random.normal(key, (1, h, sq, sk), jnp.float32).astype(q.dtype),)
  return ()


def kwargs(shape: Shape, *ops) -> dict:
  """The feature's arguments of a call (and of its reference) on ``shape``;
  ``ops`` from :func:`operands`."""
  if shape.dropout_rate:
    return dict(dropout_rate=shape.dropout_rate, dropout_seed=jnp.int32(SEED))
  if shape.mask:
    return dict(mask=ops[0])
  if shape.bias:
    return dict(bias=ops[0])
  return {}


@dataclasses.dataclass(frozen=True)
class WithFeature:
  """``fn(q, k, v, causal, *operands)`` with the shape's feature: dropout's
  arguments, or its mask or bias as operands: the full shape's
  (``operands``), passed by timing.functions as arguments of the jitted
  program (and differentiated with ``grad``), or, called with q, k, v and
  causal alone, built for their sizes (the check's smaller slice)."""
  fn: Callable
  shape: Shape
  operands: tuple
  grad: bool = False

  def __call__(self, q, k, v, causal, *ops):
    ops = ops or operands(self.shape, q, k)
    return self.fn(q, k, v, causal, **kwargs(self.shape, *ops))


def check_shape(name: str, shape: Shape) -> Shape:
  """The shape a variant is checked on: without the feature for ``[no ...]``."""
  if name.endswith(without(shape)):
    return dataclasses.replace(shape, dropout_rate=0.0, mask=False, bias=False)
  return shape


def _without_feature(name, what):
  def build(shape):
    raise NotImplementedError(f"{name} has no {what} of flashjax's contract")
  return build


def variants(fns: dict, shape: Shape, q, k) -> dict:
  """``name -> build(shape) -> fn(q, k, v, causal)`` for the CLI's built
  implementations ``fns`` on a feature shape whose timed inputs are ``q`` and
  ``k`` (see the module docstring)."""
  out, ops = {}, operands(shape, q, k)
  for name, fn in fns.items():
    impl = impls.IMPLS.get(name)
    if impl is not None and impl.kind == "flashjax":
      out[name] = lambda s, fn=fn: WithFeature(fn, s, ops, grad=s.bias)
      out[name + without(shape)] = lambda s, fn=fn: fn
    else:
      out[name] = _without_feature(name, feature(shape))
  return out
