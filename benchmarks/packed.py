"""Packed shapes (``Shape.documents``): each implementation on the packed row and
on the same documents as batched calls, side by side.

For a packed shape every implementation of the CLI becomes:

* ``<name>``: a flashjax platform on the packed row with segment ids;
* ``<name>[contiguous]``: the same with ``contiguous_segments=True`` (each
  document's ids one run: the Hopper kernels mask by position spans);
* ``<name>[batched]``: the documents as batches, one call per distinct length
  (equal lengths: a free reshape; mixed lengths: sliced and stacked per length),
  so its time is the sum of the documents' batched times;
* ``flash-attn3-jax[varlen]`` (where that peer imports) and ``flash_mha_varlen``
  (flashjax's varlen entry on the default platform): ``cu_seqlens`` offsets.

All of them compute the same ``[1, S, H, Dv]`` output, checked against the
reference with segment ids. The ids and offsets are arguments of the timed
programs (:class:`WithOperands`), as in a training step whose documents change
every batch: closed over as constants, XLA would fold their preparation (block
tables, spans, the varlen entry's ids) into the program and leave it untimed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from flashjax.common.shapes import Shape

from . import impls


def segment_ids(shape: Shape) -> np.ndarray:
  """``[B, S]`` int32: document ``n`` of each row has id ``n``."""
  ids = np.repeat(np.arange(len(shape.documents), dtype=np.int32), shape.documents)
  return np.broadcast_to(ids, (shape.batch, ids.size))


def cu_seqlens(shape: Shape) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(shape.documents)]).astype(np.int32)


def check_shape(shape: Shape, max_tokens: int = 2048) -> Shape:
  """The leading documents of ``shape`` that fit in ``max_tokens`` (the first one
  cut to fit), for the reference check."""
  docs, total = [], 0
  for n in shape.documents:
    if total + n > max_tokens:
      break
    docs.append(n)
    total += n
  if not docs:
    docs, total = [max_tokens], max_tokens
  return dataclasses.replace(shape, seq_q=total, seq_k=total, documents=tuple(docs))


@dataclasses.dataclass(frozen=True)
class WithOperands:
  """``fn(q, k, v, causal, *operands)`` with its default ``operands`` (device
  arrays): called with q, k, v and causal alone it uses them; timing.functions
  passes them as arguments of the jitted program."""
  fn: Callable
  operands: tuple

  def __call__(self, q, k, v, causal, *operands):
    return self.fn(q, k, v, causal, *(operands or self.operands))


def operands(fn) -> tuple:
  """The arguments a built implementation takes after ``(q, k, v, causal)``
  (:class:`WithOperands`, features.WithFeature)."""
  return getattr(fn, "operands", ())


def _with_segment_ids(fn, shape: Shape, **kw):
  return WithOperands(
      lambda q, k, v, causal, ids: fn(q, k, v, causal, segment_ids=(ids, ids), **kw),
      (jnp.asarray(segment_ids(shape)),))


def _batched(fn, shape: Shape):
  """The row's documents as batched calls of ``fn``; output in row order."""
  docs = shape.documents
  if shape.batch != 1:
    raise ValueError(f"packed shapes are one row, got batch={shape.batch}")
  if len(set(docs)) == 1:
    n, length = len(docs), docs[0]

    def equal(q, k, v, causal):
      split = lambda x: x.reshape(n, length, *x.shape[2:])
      out = fn(split(q), split(k), split(v), causal)
      return out.reshape(1, n * length, *out.shape[2:])
    return equal
  starts = np.concatenate([[0], np.cumsum(docs)[:-1]])
  groups = {n: [int(s) for s, m in zip(starts, docs) if m == n] for n in set(docs)}

  def mixed(q, k, v, causal):
    pieces = {}
    for n, firsts in groups.items():
      take = lambda x: jnp.stack([x[0, s:s + n] for s in firsts])
      out = fn(take(q), take(k), take(v), causal)
      pieces.update({s: out[t] for t, s in enumerate(firsts)})
    return jnp.concatenate([pieces[int(s)] for s in starts])[None]
  return mixed


def _varlen(entry, shape: Shape):
  longest = max(shape.documents)
  # By keyword: flash-attn3-jax's varlen takes seqused_k before the max lengths.
  return WithOperands(lambda q, k, v, causal, cu: entry(
      q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
      max_seqlen_k=longest, is_causal=causal)[None], (jnp.asarray(cu_seqlens(shape)),))


def _flashjax_varlen(shape: Shape):
  import flashjax
  return _varlen(flashjax.flash_mha_varlen, shape)


def _fa3_varlen(shape: Shape):
  import flash_attn3_jax
  return _varlen(flash_attn3_jax.flash_mha_varlen, shape)


def variants(fns: dict) -> dict:
  """``name -> build(shape) -> fn(q, k, v, causal)`` for the CLI's built
  implementations ``fns`` (see the module docstring)."""
  out = {}
  flashjax_seen = False
  for name, fn in fns.items():
    impl = impls.IMPLS.get(name)
    if impl is not None and impl.kind == "flashjax":
      flashjax_seen = True
      out[name] = lambda s, fn=fn: _with_segment_ids(fn, s)
      out[f"{name}[contiguous]"] = lambda s, fn=fn: _with_segment_ids(
          fn, s, contiguous_segments=True)
    if name == "flash-attn3-jax":
      out["flash-attn3-jax[varlen]"] = _fa3_varlen
    out[f"{name}[batched]"] = lambda s, fn=fn: _batched(fn, s)
  if flashjax_seen:
    out["flash_mha_varlen"] = _flashjax_varlen
  return out
