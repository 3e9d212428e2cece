"""Ring attention: exact attention over a sequence split along one mesh axis.

Inside ``shard_map``, each of the ``n`` devices of the ring axis keeps its query
rows; key/value blocks (with their segment ids) travel one device onwards per hop
by ``ppermute``, so that after ``n`` hops every query block has met every key
block. The forward merges the hops' ``(out, lse)`` exactly in fp32 through the
lse; the backward re-runs the hops with the final out and lse (the softmax of the
whole row), and the dK/dV accumulators travel with K/V, arriving home after the
last hop. Each hop issues the next hop's ``ppermute`` before its own kernel, so
XLA may overlap communication with compute.

Layouts (``LAYOUTS``): "contiguous", device ``r`` holds rows ``[r c, (r + 1) c)``;
"zigzag", the sequence in ``2n`` chunks, device ``r`` holding chunks ``r`` and
``2n - 1 - r`` (``zigzag_order``), which gives every device the same causal work.
A device's rows are cut into its chunks (one or two); each hop runs the platform's
kernel on every (q chunk, kv chunk) pair, with the pair's band in its own
coordinates (``Band.sub_block``). That band depends on the device, a traced
value, so the distinct static bands of a pair (over all hops and devices) are the
branches of a ``lax.switch`` indexed by a table ``[hop, device]``; a pair the band
cannot reach takes a branch that does nothing.

Sinks join the denominator once, after the merge; the dropout keep-mask hashes
global positions (``dropout.position_seed``), so it is the unsplit call's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import dropout as dropout_lib
from . import epilogue
from .compat import vary_like, varying_axes
from .mask import Band
from .spec import AttentionSpec, Operands

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout):
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _zigzag_chunks(num_shards: int) -> np.ndarray:
  """Chunk order of the zigzag layout: ``[0, 2n-1, 1, 2n-2, ...]``."""
  return np.array([c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)])


def _permute_chunks(x, num_shards: int, axis: int, order) -> jax.Array:
  if not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
  axis = axis % x.ndim
  size = x.shape[axis]
  if size % (2 * num_shards):
    raise ValueError(f"zigzag needs the sequence length ({size}, axis {axis}) to be "
                     f"a multiple of 2 * num_shards = {2 * num_shards}")
  chunks = x.reshape(x.shape[:axis] + (2 * num_shards, size // (2 * num_shards)) +
                     x.shape[axis + 1:])
  return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(x.shape)


def zigzag_order(x, num_shards: int, axis: int = 1):
  """``x`` with its sequence axis in zigzag order: cut into ``2 * num_shards``
  chunks, shard ``r`` of the result holding chunks ``r`` and ``2n - 1 - r``."""
  return _permute_chunks(x, num_shards, axis, _zigzag_chunks(num_shards))


def zigzag_restore(x, num_shards: int, axis: int = 1):
  """The inverse of :func:`zigzag_order`."""
  return _permute_chunks(x, num_shards, axis, np.argsort(_zigzag_chunks(num_shards)))


def to_zigzag(x, axis_name, axis: int = 1):
  """Inside ``shard_map``: this device's contiguous rows (chunks ``2r``, ``2r + 1``
  of ``2n``) exchanged for its zigzag rows (chunks ``r``, ``2n - 1 - r``), two
  ``ppermute`` of half a shard each. Device ``d`` gets chunk ``d`` and chunk
  ``2n - 1 - d``, one even and one odd: the even chunks travel in one permute, the
  odd ones in the other."""
  n = jax.lax.axis_size(axis_name)
  dest = lambda j: j if j < n else 2 * n - 1 - j
  lo, hi = jnp.split(x, 2, axis=axis)
  a = jax.lax.ppermute(lo, axis_name, [(r, dest(2 * r)) for r in range(n)])
  b = jax.lax.ppermute(hi, axis_name, [(r, dest(2 * r + 1)) for r in range(n)])
  even = jax.lax.axis_index(axis_name) % 2 == 0
  return jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)], axis=axis)


def from_zigzag(x, axis_name, axis: int = 1):
  """The inverse of :func:`to_zigzag`."""
  n = jax.lax.axis_size(axis_name)
  first, second = jnp.split(x, 2, axis=axis)
  even = jax.lax.axis_index(axis_name) % 2 == 0
  even_chunk = lambda d: d if d % 2 == 0 else 2 * n - 1 - d
  odd_chunk = lambda d: 2 * n - 1 - d if d % 2 == 0 else d
  lo = jax.lax.ppermute(jnp.where(even, first, second), axis_name,
                        [(d, even_chunk(d) // 2) for d in range(n)])
  hi = jax.lax.ppermute(jnp.where(even, second, first), axis_name,
                        [(d, odd_chunk(d) // 2) for d in range(n)])
  return jnp.concatenate([lo, hi], axis=axis)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingPlan:
  """The static half of a ring call.

  Attributes:
    axis_name: the mesh axis of the ring.
    num_shards: devices along it.
    layout: "contiguous" or "zigzag".
    band: the band of the whole (global) sequences.
    batch_axes, head_axes: mesh axes that split batch and heads (only the
      dropout hash needs their global indices).
  """

  axis_name: Any
  num_shards: int
  layout: str
  band: Band
  batch_axes: tuple = ()
  head_axes: tuple = ()

  def __post_init__(self):
    check_layout(self.layout)

  @property
  def num_chunks(self) -> int:
    return 2 if self.layout == "zigzag" else 1

  def chunk_index(self, device, chunk):
    """Global index (in chunk units) of ``device``'s ``chunk``; ints or traced."""
    if self.layout == "contiguous":
      return device
    return device if chunk == 0 else 2 * self.num_shards - 1 - device

  def offsets(self, device, hop, a: int, b: int, len_q: int, len_k: int):
    """Global ``(q, k)`` offsets of ``device``'s q chunk ``a`` (``len_q`` rows)
    and of kv chunk ``b`` (``len_k`` keys) of the shard it holds at ``hop``
    (device ``device - hop``'s); ``device`` and ``hop`` are ints or traced."""
    src = (device - hop) % self.num_shards
    return self.chunk_index(device, a) * len_q, self.chunk_index(src, b) * len_k

  def pair_bands(self, hops, a: int, b: int, len_q: int, len_k: int):
    """``bands[t][r]``: the band (None = empty) of device ``r``'s q chunk ``a``
    against the kv chunk ``b`` it meets at hop ``hops[t]``."""
    return [[self.band.sub_block(q, len_q, k, len_k)
             for q, k in (self.offsets(r, hop, a, b, len_q, len_k)
                          for r in range(self.num_shards))]
            for hop in hops]


@dataclasses.dataclass(frozen=True)
class FixedKernel:
  """A hop kernel (``forward``'s and ``backward``'s ``kernel``) that gives every
  hop the same platform functions and config: the one the whole call resolved
  (common/partition.py runs the ring inside a platform's partitioned call)."""

  forward: Any
  backward: Any
  config: Any

  def __call__(self, ops, spec):
    del ops, spec
    return self.forward, self.backward, self.config


def check_local_shapes(plan: RingPlan, spec: AttentionSpec):
  """The local sequence lengths must split into the layout's chunks."""
  for name, s in (("q", spec.seq_q), ("k", spec.seq_k)):
    if s % plan.num_chunks:
      raise ValueError(f"layout 'zigzag' needs even local sequence lengths, got "
                       f"{name} with {s} rows per device")


def hop_spec(spec: AttentionSpec, band: Band) -> AttentionSpec:
  """The spec of one (q chunk, kv chunk) kernel call: chunk sizes, the pair's
  band, the bias/mask block's shape, no sinks (added once after the merge)."""
  def block(shape):
    if shape is None:
      return None
    return shape[:2] + (band.seq_q if shape[2] > 1 else 1,
                        band.seq_k if shape[3] > 1 else 1)
  return dataclasses.replace(
      spec, seq_q=band.seq_q, seq_k=band.seq_k, band=band,
      causal=band.left is None and band.right == 0, num_sinks=0,
      bias_shape=block(spec.bias_shape), mask_shape=block(spec.mask_shape))


def shard_offset(axes, size: int):
  """This device's index along the mesh ``axes`` times ``size`` (0 where
  ``axes`` is empty): the global index of the first batch element or head of
  its shard, which the dropout hash takes."""
  return jax.lax.axis_index(axes) * size if axes else 0


def band_switch(bands, index, run, empty, *args):
  """``run(band, *args)`` with the static band ``bands[index]``, or
  ``empty(*args)`` where that band is None (the block reaches no key).

  ``bands`` is a nested list of bands (over devices, or over hops and devices)
  and ``index`` (traced: it holds the device's position) picks one entry, an int
  or a tuple of one per level. The distinct bands, in the order they first
  appear, are the branches of a ``lax.switch``; one branch is called directly.
  """
  distinct = []

  def positions(x):
    if isinstance(x, list):
      return [positions(y) for y in x]
    if x not in distinct:
      distinct.append(x)
    return distinct.index(x)

  table = np.asarray(positions(bands), np.int32)
  branches = [functools.partial(run, band) if band is not None else empty
              for band in distinct]
  if len(branches) == 1:
    return branches[0](*args)
  return jax.lax.switch(jnp.asarray(table)[index], branches, *args)


class _Ring:
  """Index helpers of one device's view of the ring."""

  def __init__(self, plan: RingPlan, spec: AttentionSpec):
    self.plan, self.spec = plan, spec
    self.n = plan.num_shards
    self.r = jax.lax.axis_index(plan.axis_name)
    self.cq = spec.seq_q // plan.num_chunks
    self.ck = spec.seq_k // plan.num_chunks
    self.pairs = [(a, b) for a in range(plan.num_chunks)
                  for b in range(plan.num_chunks)]

  def q_rows(self, x, a, axis=1):
    return jax.lax.slice_in_dim(x, a * self.cq, (a + 1) * self.cq, axis=axis)

  def kv_rows(self, x, b, axis=1):
    return jax.lax.slice_in_dim(x, b * self.ck, (b + 1) * self.ck, axis=axis)

  def rotate(self, x):
    """``x`` of device ``r`` moved to device ``r + 1``."""
    if x is None or self.n == 1:
      return x
    perm = [(i, (i + 1) % self.n) for i in range(self.n)]
    return jax.lax.ppermute(x, self.plan.axis_name, perm)

  def key_start(self, hop, b):
    """First column of kv chunk ``b`` at ``hop`` in a bias/mask whose columns are
    all keys in the layout's order (the devices' shards one after another)."""
    src = (self.r - hop) % self.n
    return src * self.spec.seq_k + b * self.ck

  def dense_block(self, x, hop, a, b):
    """The bias/mask block of pair (a, b) at ``hop`` (size-1 dims stay 1)."""
    if x is None:
      return None
    if x.shape[2] > 1:
      x = self.q_rows(x, a, axis=2)
    if x.shape[3] > 1:
      x = jax.lax.dynamic_slice_in_dim(x, self.key_start(hop, b), self.ck, axis=3)
    return x

  def seed(self, ops: Operands, hop, a, b):
    """The dropout seed of pair (a, b) at ``hop``: global offsets of its rows."""
    if ops.dropout_seed is None:
      return None
    spec, plan = self.spec, self.plan
    return dropout_lib.position_seed(
        ops.dropout_seed, shard_offset(plan.batch_axes, spec.batch),
        shard_offset(plan.head_axes, spec.heads_q),
        *plan.offsets(self.r, hop, a, b, self.cq, self.ck))

  def groups(self):
    """Hop groups: a scanned run whose hops rotate K/V onwards, then the last hop."""
    return [(list(range(self.n - 1)), True), ([self.n - 1], False)]

  def switch(self, hops, t, a, b, run, empty, *args):
    """``run(band, *args)`` with the band device ``r`` meets for pair (a, b) at hop
    ``hops[t]``; ``empty(*args)`` where it reaches nothing."""
    return band_switch(self.plan.pair_bands(hops, a, b, self.cq, self.ck),
                       (t, self.r), run, empty, *args)


def _merge(acc, part):
  """Two partial softmax results over disjoint keys, as one (fp32)."""
  (o1, l1), (o2, l2) = acc, part
  lse = jnp.logaddexp(l1, l2)
  w = lambda l: jnp.swapaxes(jnp.where(jnp.isfinite(l), jnp.exp(l - lse), 0.0),
                             1, 2)[..., None]
  return o1 * w(l1) + o2 * w(l2), lse


def forward(kernel, plan: RingPlan, ops: Operands, spec: AttentionSpec):
  """``(out [B, Sq_local, Hq, Dv], lse [B, Hq, Sq_local])`` of this device's rows.

  ``kernel(ops, spec) -> (forward, backward, config)`` gives the platform's
  functions for a hop's spec (``vjp.kernel_parts``); ``spec`` has the local sizes
  (the global band is ``plan.band``). A bias or mask has this device's rows and
  all ``n * Sk_local`` keys as columns, in the layout's order.
  """
  ring = _Ring(plan, spec)
  f32 = jnp.promote_types(ops.q.dtype, jnp.float32)
  qs = [ring.q_rows(ops.q, a) for a in range(plan.num_chunks)]
  q_ids = [None if ops.q_segment_ids is None else ring.q_rows(ops.q_segment_ids, a)
           for a in range(plan.num_chunks)]
  kv0 = (ops.k, ops.v, ops.kv_segment_ids)
  acc0 = [(vary_like(jnp.zeros(q.shape[:3] + (spec.head_dim_v,), f32), q, ops.k),
           vary_like(jnp.full((spec.batch, spec.heads_q, ring.cq), -jnp.inf, f32),
                     q, ops.k)) for q in qs]

  def run(band, sub):
    hs = hop_spec(spec, band)
    sub = Operands(**sub)
    fwd, _, config = kernel(sub, hs)
    out, lse = fwd(sub, hs, config)
    return out.astype(f32), lse.astype(f32)

  def empty(sub):
    refs = jax.tree.leaves(sub)
    return (vary_like(jnp.zeros(sub["q"].shape[:3] + (spec.head_dim_v,), f32), *refs),
            vary_like(jnp.full((spec.batch, spec.heads_q, ring.cq), -jnp.inf, f32),
                      *refs))

  def hop(hops, t, kv, acc):
    k, v, kv_ids = kv
    acc = list(acc)
    for a, b in ring.pairs:
      at = hops[0] + t
      sub = dict(q=qs[a], k=ring.kv_rows(k, b), v=ring.kv_rows(v, b),
                 bias=ring.dense_block(ops.bias, at, a, b),
                 mask=ring.dense_block(ops.mask, at, a, b), q_segment_ids=q_ids[a],
                 kv_segment_ids=None if kv_ids is None else ring.kv_rows(kv_ids, b),
                 dropout_seed=ring.seed(ops, at, a, b))
      acc[a] = _merge(acc[a], ring.switch(hops, t, a, b, run, empty, sub))
    return acc

  kv, acc = kv0, acc0
  for hops, rotates in ring.groups():
    if not hops:
      continue
    if rotates:
      def body(carry, t, hops=hops):
        kv, acc = carry
        # The next hop's blocks are sent before this hop's kernels run.
        nxt = tuple(ring.rotate(x) for x in kv)
        return (nxt, hop(hops, t, kv, acc)), None
      (kv, acc), _ = jax.lax.scan(body, (kv, acc), jnp.arange(len(hops)))
    else:
      acc = hop(hops, 0, kv, acc)

  outs, lses = [], []
  for o, l in acc:
    if spec.num_sinks:
      o, l = epilogue.add_sinks(o, l, ops.sinks)
    outs.append(o)
    lses.append(l)
  out = jnp.concatenate(outs, axis=1).astype(ops.q.dtype)
  return out, jnp.concatenate(lses, axis=2)


def _replicated_sum(g, primal):
  """Cotangent of an operand every device of the ring holds whole (sinks): the
  sum of the devices' parts, over the axes the operand does not vary along.
  Where ``shard_map`` does not track varying axes (``check_vma=False``), its own
  transpose sums the cotangents of replicated inputs, so none is taken here."""
  axes = varying_axes(g) - varying_axes(primal)
  return jax.lax.psum(g, tuple(sorted(axes))) if axes else g


def backward(kernel, plan: RingPlan, ops: Operands, spec: AttentionSpec, out, lse,
             do, dlse) -> Operands:
  """Cotangents of the operands of this device, from the final ``out`` and ``lse``."""
  ring = _Ring(plan, spec)
  f32 = jnp.promote_types(ops.q.dtype, jnp.float32)
  rows = lambda x, a, axis=1: ring.q_rows(x, a, axis)
  chunk = [dict(q=rows(ops.q, a), out=rows(out, a), do=rows(do, a),
                lse=rows(lse, a, 2), dlse=rows(dlse, a, 2),
                ids=None if ops.q_segment_ids is None else rows(ops.q_segment_ids, a))
           for a in range(plan.num_chunks)]
  refs = (ops.q, ops.k, do, lse)
  like = lambda x: vary_like(jnp.zeros(x.shape, f32), *refs)
  dq0 = [like(c["q"]) for c in chunk]
  dkv0 = (like(ops.k), like(ops.v))
  db0 = None if ops.bias is None else like(ops.bias)

  def run(band, c, sub):
    hs = hop_spec(spec, band)
    sub = Operands(**sub)
    _, bwd, config = kernel(sub, hs)
    g = bwd(sub, hs, config, c["out"], c["lse"], c["do"], c["dlse"])
    return (g.q.astype(f32), g.k.astype(f32), g.v.astype(f32),
            None if g.bias is None else g.bias.astype(f32))

  def empty(c, sub):
    refs = jax.tree.leaves((c, sub))
    z = lambda x: None if x is None else vary_like(jnp.zeros(x.shape, f32), *refs)
    return z(sub["q"]), z(sub["k"]), z(sub["v"]), z(sub["bias"])

  def hop(hops, t, kv, dkv, dq, dbias):
    k, v, kv_ids = kv
    dk, dv = dkv
    dq = list(dq)
    for a, b in ring.pairs:
      at = hops[0] + t
      sub = dict(q=chunk[a]["q"], k=ring.kv_rows(k, b), v=ring.kv_rows(v, b),
                 bias=ring.dense_block(ops.bias, at, a, b),
                 mask=ring.dense_block(ops.mask, at, a, b),
                 q_segment_ids=chunk[a]["ids"],
                 kv_segment_ids=None if kv_ids is None else ring.kv_rows(kv_ids, b),
                 dropout_seed=ring.seed(ops, at, a, b))
      g = ring.switch(hops, t, a, b, run, empty, chunk[a], sub)
      dq[a] = dq[a] + g[0]
      sl = slice(b * ring.ck, (b + 1) * ring.ck)
      dk = dk.at[:, sl].add(g[1])
      dv = dv.at[:, sl].add(g[2])
      if dbias is not None:
        dbias = _add_block(dbias, g[3], ring, at, a, b)
    # The accumulators follow their K/V block; after the last hop they are home.
    return (ring.rotate(dk), ring.rotate(dv)), dq, dbias

  kv, dkv, dq, dbias = (ops.k, ops.v, ops.kv_segment_ids), dkv0, dq0, db0
  for hops, rotates in ring.groups():
    if not hops:
      continue
    if rotates:
      def body(carry, t, hops=hops):
        kv, dkv, dq, dbias = carry
        nxt = tuple(ring.rotate(x) for x in kv)
        dkv, dq, dbias = hop(hops, t, kv, dkv, dq, dbias)
        return (nxt, dkv, dq, dbias), None
      (kv, dkv, dq, dbias), _ = jax.lax.scan(body, (kv, dkv, dq, dbias),
                                             jnp.arange(len(hops)))
    else:
      dkv, dq, dbias = hop(hops, 0, kv, dkv, dq, dbias)

  dsinks = None
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, epilogue.delta(out, do, dlse))
    dsinks = _replicated_sum(dsinks, ops.sinks)
  if dbias is not None:
    if ops.bias.shape[2] == 1:  # one bias row for all rows of the ring
      dbias = _replicated_sum(dbias, ops.bias)
    dbias = dbias.astype(ops.bias.dtype)
  return Operands(q=jnp.concatenate(dq, axis=1).astype(ops.q.dtype),
                  k=dkv[0].astype(ops.k.dtype), v=dkv[1].astype(ops.v.dtype),
                  bias=dbias, sinks=dsinks)


def _add_block(dbias, g, ring: _Ring, hop, a, b):
  """``dbias`` plus pair (a, b)'s block ``g`` at its rows and columns."""
  starts = [0, 0, a * ring.cq if dbias.shape[2] > 1 else 0,
            ring.key_start(hop, b) if dbias.shape[3] > 1 else 0]
  old = jax.lax.dynamic_slice(dbias, starts, g.shape)
  return jax.lax.dynamic_update_slice(dbias, old + g, starts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(static, ops: Operands):
  kernel, plan, spec = static
  return forward(kernel, plan, ops, spec)


def _ring_fwd(static, ops):
  out, lse = _ring(static, ops)
  return (out, lse), (ops, out, lse)


def _ring_bwd(static, res, cotangents):
  kernel, plan, spec = static
  ops, out, lse = res
  grads = backward(kernel, plan, ops, spec, out, lse, *cotangents)
  keep = {"q", "k", "v", "bias", "sinks"}
  return (Operands(*(g if name in keep else None
                     for name, g in zip(Operands._fields, grads))),)


_ring.defvjp(_ring_fwd, _ring_bwd)


def attention(kernel, plan: RingPlan, ops: Operands, spec: AttentionSpec):
  """``(out, lse)`` of this device's rows, differentiable (one ``custom_vjp``
  over the whole ring). ``kernel`` must be hashable."""
  check_local_shapes(plan, spec)
  return _ring((kernel, plan, spec), ops)
