"""Dropout shapes (``Shape.dropout_rate``): each flashjax implementation with
dropout and without it, side by side in interleaved rounds, so the cost of the
feature is a ratio of one run.

For a dropout shape every flashjax implementation of the CLI becomes:

* ``<name>``: the call with ``dropout_rate`` and a fixed seed, checked against
  the reference with the same dropout (one hash on every platform);
* ``<name>[no dropout]``: the same call without dropout.

Peers have no dropout of this contract; their rows say so.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flashjax.common.shapes import Shape

from . import impls

SEED = 1234
WITHOUT = "[no dropout]"


def kwargs(shape: Shape) -> dict:
  """The dropout arguments of a call (and of its reference) on ``shape``."""
  if not shape.dropout_rate:
    return {}
  return dict(dropout_rate=shape.dropout_rate, dropout_seed=jnp.int32(SEED))


def check_shape(name: str, shape: Shape) -> Shape:
  """The shape a variant is checked on: without dropout for ``[no dropout]``."""
  return dataclasses.replace(shape, dropout_rate=0.0) if name.endswith(WITHOUT) else shape


def _with_dropout(fn, shape: Shape):
  kw = kwargs(shape)
  return lambda q, k, v, causal: fn(q, k, v, causal, **kw)


def _no_dropout(name):
  def build(shape):
    raise NotImplementedError(f"{name} has no dropout of flashjax's contract")
  return build


def variants(fns: dict) -> dict:
  """``name -> build(shape) -> fn(q, k, v, causal)`` for the CLI's built
  implementations ``fns`` (see the module docstring)."""
  out = {}
  for name, fn in fns.items():
    impl = impls.IMPLS.get(name)
    if impl is not None and impl.kind == "flashjax":
      out[name] = lambda s, fn=fn: _with_dropout(fn, s)
      out[name + WITHOUT] = lambda s, fn=fn: fn
    else:
      out[name] = _no_dropout(name)
  return out
