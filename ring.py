"""Ring attention on sequence shards, for use inside ``shard_map``
(common/ring.py holds the ring itself)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import api
from .common import ring as ring_lib
from .common import spec as spec_lib
from .common import vjp
from .common.mask import Band
from .common.ring import LAYOUTS, zigzag_order, zigzag_restore


@dataclasses.dataclass(frozen=True)
class HopKernel:
  """The platform choice of a ring call; called with one hop's operands and spec,
  returns the platform's ``(forward, backward, config)``."""

  backend: str
  platform: str | None
  config: Any = None
  interpret: bool = False

  def __call__(self, ops, spec):
    return vjp.kernel_parts(lambda: api.dispatch(
        ops, spec, backend=self.backend, platform=self.platform, config=self.config,
        interpret=self.interpret))


def ring_attention(q, k, v, *, axis_name, layout: str = "contiguous", causal=False,
                   sliding_window=None, segment_ids=None, softmax_scale=None,
                   logits_soft_cap=None, sinks=None, dropout_rate=0.0,
                   dropout_seed=None, return_lse=False, bias=None, mask=None,
                   contiguous_segments=False, backend=None, platform=None,
                   config=None, interpret=False):
  """Exact attention over sequences split along the mesh axis ``axis_name``; call
  it inside ``shard_map`` on each device's shard.

  Device ``r`` of the ``n`` along ``axis_name`` holds rows of q, k and v (and of the
  segment ids) by ``layout``: "contiguous", rows ``[r S/n, (r + 1) S/n)`` of each;
  "zigzag", chunks ``r`` and ``2n - 1 - r`` of ``2n`` (``zigzag_order`` puts a
  whole sequence in that order), which balances causal work. K/V blocks travel
  around the ring (``ppermute``); nothing is gathered. The result is the
  unsplit call's on the whole sequences, in the same layout: causal and windows
  are aligned on the global sequences, sinks count once, dropout hashes global
  positions (batch and head indices are the shard's own).

  Args:
    q, k, v: local shards ``[B, Sq/n, Hq, D]``, ``[B, Sk/n, Hkv, D]``,
      ``[B, Sk/n, Hkv, Dv]``.
    axis_name: the mesh axis (of the enclosing ``shard_map``) splitting the
      sequences.
    layout: "contiguous" or "zigzag".
    causal, sliding_window, segment_ids (local shards), softmax_scale,
      logits_soft_cap, sinks, dropout_rate, dropout_seed, return_lse,
      contiguous_segments (accepted; the hops compare ids, ``ring.hop_spec``),
      backend, platform, config, interpret: as in ``flash_attention``.
    bias, mask: broadcastable to ``[B, Hq, Sq/n, Sk]``: this device's query rows
      and all keys as columns, in the layout's order (the devices' shards one
      after another); a bias with one row for all queries gets its gradient
      summed over the ring.

  Returns:
    The local ``out [B, Sq/n, Hq, Dv]``, or ``(out, lse [B, Hq, Sq/n])``.
  """
  return _ring_attention(
      q, k, v, axis_name=axis_name, layout=layout, causal=causal,
      sliding_window=sliding_window, segment_ids=segment_ids,
      softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
      dropout_rate=dropout_rate, dropout_seed=dropout_seed, return_lse=return_lse,
      bias=bias, mask=mask, contiguous_segments=contiguous_segments, backend=backend,
      platform=platform, config=config, interpret=interpret)


def _ring_attention(q, k, v, *, axis_name, layout="contiguous", causal=False,
                    sliding_window=None, segment_ids=None, softmax_scale=None,
                    logits_soft_cap=None, sinks=None, dropout_rate=0.0,
                    dropout_seed=None, return_lse=False, bias=None, mask=None,
                    contiguous_segments=False, backend=None, platform=None,
                    config=None, interpret=False, batch_axes=(), head_axes=()):
  ring_lib.check_layout(layout)
  try:
    n = jax.lax.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as e:
    raise ValueError(f"ring_attention runs inside shard_map with axis_name a mesh "
                     f"axis; axis_name={axis_name!r} is not bound ({e})") from e
  ops, spec = spec_lib.canonicalize(
      q, k, v, causal=causal, sliding_window=sliding_window,
      segment_ids=segment_ids, softmax_scale=softmax_scale,
      logits_soft_cap=logits_soft_cap, sinks=sinks, dropout_rate=dropout_rate,
      dropout_seed=dropout_seed, return_lse=return_lse,
      contiguous_segments=contiguous_segments)
  # Bias and mask rows are this device's; their columns are all keys.
  full = (spec.batch, spec.heads_q, spec.seq_q, n * spec.seq_k)
  shapes = {}
  for name, x, kind in (("bias", bias, "float"), ("mask", mask, "bool")):
    if x is not None:
      x, shapes[f"{name}_shape"] = spec_lib.broadcast_rank4(x, name, full, kind=kind)
      ops = ops._replace(**{name: x})
  spec = dataclasses.replace(spec, **shapes)
  band = Band(seq_q=n * spec.seq_q, seq_k=n * spec.seq_k, left=spec.band.left,
              right=spec.band.right)
  plan = ring_lib.RingPlan(axis_name=axis_name, num_shards=n, layout=layout,
                           band=band, batch_axes=tuple(batch_axes),
                           head_axes=tuple(head_axes))
  backend = api.detect_backend(backend, q)
  kernel = HopKernel(backend, platform, config, bool(interpret))
  out, lse = ring_lib.attention(kernel, plan, ops, spec)
  return (out, lse) if return_lse else out


__all__ = ["ring_attention", "zigzag_order", "zigzag_restore", "LAYOUTS"]


def _entry_axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _sharding(x):
  """``x``'s NamedSharding: a concrete array's own, or (under ``jit``) its type's,
  which names mesh axes when the mesh's axes are Explicit; else None."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    sharding = getattr(x, "sharding", None)
  else:
    try:
      sharding = getattr(jax.typeof(x), "sharding", None)
    except TypeError:  # not an array: canonicalize names the argument
      return None
  if sharding is None or getattr(sharding, "spec", None) is None or not hasattr(
      sharding, "mesh"):
    return None
  return sharding


def sequence_axis(q, k):
  """``(mesh, axis, batch_axes, head_axes)`` when q and k are split along their
  sequence axis by the same single mesh axis that is known at trace time, else
  None (then ``flash_attention`` runs unsplit rows, gathering)."""
  if getattr(q, "ndim", None) != 4 or getattr(k, "ndim", None) != 4:
    return None
  sq, sk = _sharding(q), _sharding(k)
  if sq is None or sk is None:
    return None
  pq = tuple(sq.spec) + (None,) * (4 - len(tuple(sq.spec)))
  pk = tuple(sk.spec) + (None,) * (4 - len(tuple(sk.spec)))
  seq = _entry_axes(pq[1])
  if len(seq) != 1 or _entry_axes(pk[1]) != seq:
    return None
  mesh = sq.mesh
  if mesh.shape[seq[0]] == 1:
    return None
  size = lambda axes: int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  batch = tuple(a for a in _entry_axes(pq[0]) if a not in seq)
  heads = tuple(a for a in _entry_axes(pq[2]) if a not in seq)
  if q.shape[0] % size(batch):
    batch = ()
  if k.shape[2] % size(heads):
    heads = ()
  return mesh, seq[0], batch, heads


def sharded_call(route, q, k, v, *, bias=None, mask=None, segment_ids=None,
                 sinks=None, dropout_seed=None, return_lse=False, **kwargs):
  """``flash_attention`` on sequence-split q/k/v (``route`` from
  :func:`sequence_axis`): a ring over the sequence axis inside ``shard_map``,
  batch and heads split along their own mesh axes."""
  mesh, axis, batch, heads = route
  b, h = batch or None, heads or None
  row = P(b, axis, h, None)
  if segment_ids is not None:
    segment_ids = tuple(segment_ids)

  def dense(x):
    if x is None:
      return None
    x = jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)
    return x, P(b if x.shape[0] > 1 else None, h if x.shape[1] > 1 else None,
                axis if x.shape[2] > 1 else None, None)

  args = dict(q=(q, row), k=(k, row), v=(v, row), bias=dense(bias),
              mask=dense(mask),
              segment_ids=None if segment_ids is None else (
                  segment_ids, (P(b, axis), P(b, axis))),
              sinks=None if sinks is None else (sinks, P(h)),
              dropout_seed=None if dropout_seed is None else (
                  jnp.asarray(dropout_seed), P()))
  args = {n: a for n, a in args.items() if a is not None}

  n = mesh.shape[axis]
  # Causal rows see more keys the later they are: the ring runs in the zigzag
  # layout, reached by two ppermutes of half a shard each way.
  zigzag = (kwargs.get("causal") and q.shape[1] == k.shape[1]
            and q.shape[1] % (2 * n) == 0)

  def local(ops):
    if zigzag:
      ops = dict(ops)
      for name in ("q", "k", "v"):
        ops[name] = ring_lib.to_zigzag(ops[name], axis)
      if "segment_ids" in ops:
        ops["segment_ids"] = tuple(ring_lib.to_zigzag(x, axis)
                                   for x in ops["segment_ids"])
      for name in ("bias", "mask"):
        if name in ops:
          x = ops[name]
          x = ring_lib.to_zigzag(x, axis, 2) if x.shape[2] > 1 else x
          ops[name] = zigzag_order(x, n, 3) if x.shape[3] > 1 else x
    out, lse = _ring_attention(**ops, axis_name=axis, return_lse=True,
                               layout="zigzag" if zigzag else "contiguous",
                               batch_axes=batch, head_axes=heads, **kwargs)
    if zigzag:
      out, lse = ring_lib.from_zigzag(out, axis), ring_lib.from_zigzag(lse, axis, 2)
    return out, lse

  specs = {n: s for n, (_, s) in args.items()}
  values = {n: x for n, (x, _) in args.items()}
  if jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
    # Explicit mesh axes: shard_map takes operands already laid out as it asks.
    values = jax.tree.map(
        lambda x, p: jax.sharding.reshard(x, NamedSharding(mesh, p)), values, specs,
        is_leaf=lambda x: isinstance(x, P))
  out, lse = jax.shard_map(
      local, mesh=mesh, in_specs=(specs,), out_specs=(row, P(b, h, axis)),
      check_vma=False)(values)
  return (out, lse) if return_lse else out
