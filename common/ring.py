"""Ring attention: exact attention over a sequence split along one mesh axis.

Inside ``shard_map``, each of the ``n`` devices of the ring axis keeps its query
rows; key/value blocks (with their segment ids) travel one device onwards per hop
by ``ppermute``, so that after ``n`` hops every query block has met every key
block. The forward merges the hops' ``(out, lse)`` exactly in fp32 through the
lse; the backward re-runs the hops with the final out and lse (the softmax of the
whole row), and the dK/dV accumulators travel one hop behind their K/V block,
arriving home beside the last hop, which is the device's own block. Each hop
sends one message (``Packet``: what travels, bitcast into one buffer) before its
own kernels run, so that the transfer can run beside them: XLA's GPU scheduler
keeps one collective-permute in flight at a time, and ran a second one of the
same hop synchronously (2026-11-26, jax 0.11.2, two H200s: V's transfer waited
130 us before any kernel while K's ran beside the kernels).

Layouts (``LAYOUTS``): "contiguous", device ``r`` holds rows ``[r c, (r + 1) c)``;
"zigzag", the sequence in ``2n`` chunks, device ``r`` holding chunks ``r`` and
``2n - 1 - r`` (``zigzag_order``), which gives every device the same causal work.
A device's rows are cut into its chunks (one or two); each hop runs the platform's
kernel on the calls of ``RingPlan.hop_calls``: (q chunk, kv chunk) pairs, joined
into one call where one band fits them, each band in the call's own coordinates
(``Band.sub_block``). The calls depend on the device, a traced value, so the
distinct call lists (over all hops and devices) are the branches of a
``lax.switch`` indexed by a table ``[hop, device]``; a device whose band
reaches nothing takes a branch that does nothing.

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
from . import rows as rows_lib
from .compat import vary_like, varying_axes
from .mask import Band
from .platform import traced_once
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

  def pair_band(self, device: int, hop: int, a: int, b: int, len_q: int,
                len_k: int):
    """The band (None = empty) of ``device``'s q chunk ``a`` against the kv
    chunk ``b`` it meets at ``hop``, in the pair's own coordinates."""
    q, k = self.offsets(device, hop, a, b, len_q, len_k)
    return self.band.sub_block(q, len_q, k, len_k)

  def hop_calls(self, device: int, hop: int, len_q: int, len_k: int,
                positions: bool = False):
    """The kernel calls of ``device`` at ``hop``: a tuple of ``(rows, keys,
    band)``, ``rows`` a range ``(start, stop)`` of its q chunks, ``keys`` a range
    of the kv chunks it holds, ``band`` in the call's own coordinates; None when
    the band reaches no key.

    Adjacent chunks share a call where one band over them gives every chunk pair
    exactly the pair's own band. In the zigzag layout, without dropout, every
    hop of a causal ring is one call: the own block a causal band over both
    chunks, any other block both rows against its first chunk or the last rows
    against both chunks. One larger call runs faster than its pairs, and needs no
    merge between them.
    ``positions``: a call's chunks must also be adjacent in the whole sequence
    (the dropout hash takes a call's first row and key as its offsets).
    """
    nc = self.num_chunks
    offsets = lambda a, b: self.offsets(device, hop, a, b, len_q, len_k)
    pair = {(a, b): self.pair_band(device, hop, a, b, len_q, len_k)
            for a in range(nc) for b in range(nc)}
    invalid = object()

    def call(rows, keys):
      (a0, a1), (b0, b1) = rows, keys
      q0, k0 = offsets(a0, b0)
      if positions and (
          any(offsets(a + 1, b0)[0] != offsets(a, b0)[0] + len_q
              for a in range(a0, a1 - 1)) or
          any(offsets(a0, b + 1)[1] != offsets(a0, b)[1] + len_k
              for b in range(b0, b1 - 1))):
        return invalid
      band = self.band.sub_block(q0, (a1 - a0) * len_q, k0, (b1 - b0) * len_k)
      for a in range(a0, a1):
        for b in range(b0, b1):
          got = None if band is None else band.sub_block(
              (a - a0) * len_q, len_q, (b - b0) * len_k, len_k)
          if got != pair[a, b]:
            return invalid
      return band

    whole, one = (0, nc), [(i, i + 1) for i in range(nc)]
    best = None
    for rects in ([(whole, whole)], [(r, whole) for r in one],
                  [(whole, k) for k in one], [(r, k) for r in one for k in one]):
      bands = [call(*rect) for rect in rects]
      if any(b is invalid for b in bands):
        continue
      calls = tuple((r, k, b) for (r, k), b in zip(rects, bands) if b is not None)
      if best is None or len(calls) < len(best):
        best = calls
    return best or None


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


@dataclasses.dataclass(frozen=True)
class Packet:
  """Arrays of mixed dtypes as one flat buffer, so that one ``ppermute`` moves
  them all. Where all share one dtype (the forward's K and V) it is the
  buffer's unit, so that a kernel can read them there (``unpack(...,
  rows=True)``); else the unit is the unsigned int of the smallest item size
  and wider items become several units (``bitcast_convert_type``). Other bits
  never travel as floats: XLA may canonicalise them (on CPU the fp32 dK/dV
  bits seen as bf16 came back changed, 2026-11-26).

  Attributes:
    shapes, dtypes: of the arrays, in order.
  """

  shapes: tuple
  dtypes: tuple

  @classmethod
  def of(cls, arrays):
    return cls(tuple(x.shape for x in arrays), tuple(jnp.dtype(x.dtype) for x in arrays))

  @property
  def unit(self):
    if len(set(self.dtypes)) == 1 and self.dtypes[0] != jnp.bool_:
      return self.dtypes[0]
    return jnp.dtype(f"uint{8 * min(d.itemsize for d in self.dtypes)}")

  def _ratio(self, dtype) -> int:
    return dtype.itemsize // self.unit.itemsize

  def pack(self, arrays) -> jax.Array:
    flat = []
    for x, dtype in zip(rows_lib.materialize(list(arrays)), self.dtypes):
      x = x.astype(jnp.uint8 if dtype == jnp.bool_ else dtype)  # bools don't bitcast
      flat.append(jax.lax.bitcast_convert_type(x, self.unit).reshape(-1))
    return flat[0] if len(flat) == 1 else jnp.concatenate(flat)

  def unpack(self, buf, rows: bool = False) -> list:
    """The arrays of ``buf``. With ``rows``, an array of the unit's dtype whose
    rows (axes 2 onwards) divide the buffer evenly comes as a ``rows.Rows``
    window of the buffer seen as ``[units / row, *shape[1:]]`` (a bitcast),
    which no copy precedes."""
    out, at = [], 0
    for shape, dtype in zip(self.shapes, self.dtypes):
      r = self._ratio(dtype)
      size = int(np.prod(shape, dtype=np.int64)) * r
      inner = int(np.prod(shape[1:], dtype=np.int64))
      if (rows and dtype == self.unit and len(shape) >= 2 and inner and
          buf.shape[0] % inner == 0 and at % inner == 0):
        base = buf.reshape((buf.shape[0] // inner,) + tuple(shape[1:]))
        out.append(rows_lib.Rows(base, at // inner, shape[0], 0, shape[1]))
        at += size
        continue
      y = jax.lax.slice_in_dim(buf, at, at + size).reshape(
          shape + ((r,) if r > 1 else ()))
      if dtype == jnp.bool_:
        out.append(jax.lax.bitcast_convert_type(y, jnp.uint8).astype(dtype))
      else:
        out.append(jax.lax.bitcast_convert_type(y, dtype))
      at += size
    return out


def check_local_shapes(plan: RingPlan, spec: AttentionSpec):
  """The local sequence lengths must split into the layout's chunks."""
  for name, s in (("q", spec.seq_q), ("k", spec.seq_k)):
    if s % plan.num_chunks:
      raise ValueError(f"layout 'zigzag' needs even local sequence lengths, got "
                       f"{name} with {s} rows per device")


def hop_spec(spec: AttentionSpec, band: Band) -> AttentionSpec:
  """The spec of one kernel call of a hop (``RingPlan.hop_calls``): its sizes
  and band, the bias/mask block's shape, no sinks (added once after the merge),
  and ids compared, not spans: a shard's ids (two far-apart chunks in the
  zigzag layout) need not lie within its own length, as
  ``segments.spans``' hash slots require of ``contiguous_segments``."""
  def block(shape):
    if shape is None:
      return None
    return shape[:2] + (band.seq_q if shape[2] > 1 else 1,
                        band.seq_k if shape[3] > 1 else 1)
  return dataclasses.replace(
      spec, seq_q=band.seq_q, seq_k=band.seq_k, band=band,
      causal=band.left is None and band.right == 0, num_sinks=0,
      bias_shape=block(spec.bias_shape), mask_shape=block(spec.mask_shape),
      contiguous_segments=False)


def shard_offset(axes, size: int):
  """This device's index along the mesh ``axes`` times ``size`` (0 where
  ``axes`` is empty): the global index of the first batch element or head of
  its shard, which the dropout hash takes."""
  return jax.lax.axis_index(axes) * size if axes else 0


def band_switch(bands, index, run, empty, *args):
  """``run(band, *args)`` with the static band ``bands[index]``, or
  ``empty(*args)`` where that band is None (the block reaches no key).

  ``bands`` is a nested list of bands, or of any hashable static entries such as
  a hop's calls (over devices, or over hops and devices), and ``index`` (traced:
  it holds the device's position) picks one entry, an int or a tuple of one per
  level. The distinct entries, in the order they first appear, are the branches
  of a ``lax.switch``; one branch is called directly.
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
  """Index helpers of one device's view of the ring. A call's ``rows`` and
  ``keys`` are chunk ranges ``(start, stop)`` (``RingPlan.hop_calls``)."""

  def __init__(self, plan: RingPlan, spec: AttentionSpec, positions: bool):
    self.plan, self.spec, self.positions = plan, spec, positions
    self.n = plan.num_shards
    self.r = jax.lax.axis_index(plan.axis_name)
    self.cq = spec.seq_q // plan.num_chunks
    self.ck = spec.seq_k // plan.num_chunks
    self.all = (0, plan.num_chunks)

  @staticmethod
  def _chunks(x, span, size, axis):
    if x is None or span == (0, x.shape[axis] // size):
      return x
    start, stop = span[0] * size, span[1] * size
    if isinstance(x, rows_lib.Rows):
      assert axis == 1, axis
      return x.rows(start, stop - start)
    return jax.lax.slice_in_dim(x, start, stop, axis=axis)

  def q_rows(self, x, rows, axis=1):
    """The chunk range ``rows`` of ``x``'s rows (a ``Rows`` stays one)."""
    return self._chunks(x, rows, self.cq, axis)

  def kv_rows(self, x, keys, axis=1):
    return self._chunks(x, keys, self.ck, axis)

  def rotate(self, x):
    """``x`` of device ``r`` moved to device ``r + 1``."""
    if x is None or self.n == 1:
      return x
    perm = [(i, (i + 1) % self.n) for i in range(self.n)]
    return jax.lax.ppermute(x, self.plan.axis_name, perm)

  @staticmethod
  def kv_leaves(ops: Operands) -> list:
    """What travels of a K/V block: K, V and their segment ids where given."""
    return [x for x in (ops.k, ops.v, ops.kv_segment_ids) if x is not None]

  @staticmethod
  def kv_triple(leaves) -> tuple:
    """``(k, v, kv_ids)`` of ``kv_leaves``' list (ids None when absent)."""
    return tuple(leaves[:3]) if len(leaves) == 3 else (leaves[0], leaves[1], None)

  def key_start(self, hop, keys):
    """First column of ``keys`` at ``hop`` in a bias/mask whose columns are all
    keys in the layout's order (the devices' shards one after another)."""
    src = (self.r - hop) % self.n
    return src * self.spec.seq_k + keys[0] * self.ck

  def dense_block(self, x, hop, rows, keys):
    """The bias/mask block of a call at ``hop`` (size-1 dims stay 1)."""
    if x is None:
      return None
    if x.shape[2] > 1:
      x = self.q_rows(x, rows, axis=2)
    if x.shape[3] > 1:
      x = jax.lax.dynamic_slice_in_dim(x, self.key_start(hop, keys),
                                       (keys[1] - keys[0]) * self.ck, axis=3)
    return x

  def operands(self, ops: Operands, kv, hop, rows, keys) -> Operands:
    """A call's operands: its rows of q, its keys of the block ``kv`` held at
    ``hop``, the bias/mask block, and the dropout seed of its first row and key
    (global offsets). q, K and V are ``rows.Rows`` windows (:func:`call_args`)."""
    k, v, kv_ids = kv
    seed = None
    if ops.dropout_seed is not None:
      spec, plan = self.spec, self.plan
      seed = dropout_lib.position_seed(
          ops.dropout_seed, shard_offset(plan.batch_axes, spec.batch),
          shard_offset(plan.head_axes, spec.heads_q),
          *plan.offsets(self.r, hop, rows[0], keys[0], self.cq, self.ck))
    window = rows_lib.Rows.of
    return Operands(
        q=self.q_rows(window(ops.q), rows), k=self.kv_rows(window(k), keys),
        v=self.kv_rows(window(v), keys),
        bias=self.dense_block(ops.bias, hop, rows, keys),
        mask=self.dense_block(ops.mask, hop, rows, keys),
        q_segment_ids=self.q_rows(ops.q_segment_ids, rows),
        kv_segment_ids=self.kv_rows(rows_lib.materialize(kv_ids), keys),
        dropout_seed=seed)

  def calls(self, hops):
    """The calls (``RingPlan.hop_calls``) of every device at each of ``hops``."""
    return [[self.plan.hop_calls(r, hop, self.cq, self.ck, self.positions)
             for r in range(self.n)] for hop in hops]

  def result_dtype(self, hops, side: int, dtype):
    """The dtype of a hop's result over the rows (``side`` 0) or keys (1) of
    ``hops``: the kernels' ``dtype`` where no two calls of a hop share a chunk
    on that side (a result is the kernels' outputs side by side), float32
    where some do (they are summed or merged). A hop's result then leaves its
    ``lax.switch`` unconverted, and the conversion fuses into the accumulation
    after it; converted in the branch it was a copy of its own (two of 25 us
    per backward hop in the scan, 8k rows per GPU on four H200s, 2026-11-26)."""
    f32 = jnp.promote_types(dtype, jnp.float32)
    for per_device in self.calls(hops):
      for calls in per_device:
        seen = set()
        for call in calls or ():
          chunks = set(range(*call[side]))
          if seen & chunks:
            return f32
          seen |= chunks
    return jnp.dtype(dtype)

  def by_chunks(self, parts, combine, blank, axes, size):
    """One result over all chunks from ``parts``, a list of ``(range, tree)``
    whose ranges cover some chunks (``tree``'s leaves split along ``axes``, one
    chunk every ``size``): per chunk the ``combine`` of the parts over it, or
    ``blank(a)`` (chunk ``a``'s tree) where none is, concatenated."""
    if all(r == self.all for r, _ in parts):
      return functools.reduce(combine, [x for _, x in parts])
    pieces = []
    for a in range(self.plan.num_chunks):
      mine = [jax.tree.map(lambda x, ax, r=r: jax.lax.slice_in_dim(
                  x, (a - r[0]) * size, (a - r[0] + 1) * size, axis=ax), x, axes)
              for r, x in parts if r[0] <= a < r[1]]
      pieces.append(functools.reduce(combine, mine) if mine else blank(a))
    return jax.tree.map(lambda ax, *xs: jnp.concatenate(xs, axis=ax), axes, *pieces)

  def switch(self, hops, t, run, empty, *args):
    """``run(calls, *args)`` with the calls (``RingPlan.hop_calls``) of device
    ``r`` at hop ``hops[t]``; ``empty(*args)`` where it has none."""
    return band_switch(self.calls(hops), (t, self.r), run, empty, *args)

  def hops(self, step, carry, message):
    """Runs ``step(hops, t, block, carry) -> carry`` over the ring's hops, hop
    ``0`` on this device's own block; before each hop's kernels the block leaves
    for the next device, as one message (``Packet``). ``message`` holds the
    block's leaves. Hops ``1 .. n - 2`` run in one ``scan``."""
    n = self.n
    if n == 1:
      return step([0], 0, self.kv_triple(message), carry)
    packet = Packet.of(message)
    block = lambda buf: self.kv_triple(packet.unpack(buf, rows=True))
    sent = self.rotate(packet.pack(message))
    carry = step([0], 0, self.kv_triple(message), carry)
    buf, mid = sent, list(range(1, n - 1))
    if mid:
      def body(c, t):
        buf, carry = c
        return (self.rotate(buf), step(mid, t, block(buf), carry)), None
      (buf, carry), _ = jax.lax.scan(body, (buf, carry), jnp.arange(len(mid)))
    return step([n - 1], 0, block(buf), carry)


def call_args(fn, *args):
  """``args`` for the platform function ``fn``: ``rows.Rows`` windows as they
  are where it reads them in place (``rows.takes_rows``), else sliced."""
  return args if rows_lib.accepts(fn) else rows_lib.materialize(args)


def _merge(acc, part):
  """Two partial softmax results over disjoint keys, as one (fp32)."""
  (o1, l1), (o2, l2) = acc, part
  f32 = jnp.promote_types(o1.dtype, jnp.float32)
  lse = jnp.logaddexp(l1, l2)
  w = lambda l: jnp.swapaxes(jnp.where(jnp.isfinite(l), jnp.exp(l - lse), 0.0),
                             1, 2)[..., None]
  return o1.astype(f32) * w(l1) + o2.astype(f32) * w(l2), lse


def forward(kernel, plan: RingPlan, ops: Operands, spec: AttentionSpec):
  """``(out [B, Sq_local, Hq, Dv], lse [B, Hq, Sq_local])`` of this device's rows.

  ``kernel(ops, spec) -> (forward, backward, config)`` gives the platform's
  functions for a hop's spec (``vjp.kernel_parts``); ``spec`` has the local sizes
  (the global band is ``plan.band``). A bias or mask has this device's rows and
  all ``n * Sk_local`` keys as columns, in the layout's order.
  """
  ring = _Ring(plan, spec, positions=ops.dropout_seed is not None)
  f32 = jnp.promote_types(ops.q.dtype, jnp.float32)
  out_shape = ops.q.shape[:3] + (spec.head_dim_v,)

  def empty(dtype, rows, *refs):
    return (vary_like(jnp.zeros(out_shape[:1] + (rows,) + out_shape[2:], dtype),
                      ops.q, *refs),
            vary_like(jnp.full((spec.batch, spec.heads_q, rows), -jnp.inf, f32),
                      ops.q, *refs))

  def run(dtype, calls, kv, at):
    """This device's (out, lse) over all its rows against the block ``kv``."""
    parts = []
    for rows, keys, band in calls:
      sub, hs = ring.operands(ops, kv, at, rows, keys), hop_spec(spec, band)
      fwd, _, config = kernel(rows_lib.materialize(sub), hs)
      out, lse = traced_once(fwd)(*call_args(fwd, sub), hs, config)
      parts.append((rows, (out, lse.astype(f32))))
    # Calls over some chunks' rows: merged chunk by chunk, then concatenated.
    out, lse = ring.by_chunks(
        parts, _merge, lambda a: empty(dtype, ring.cq, *jax.tree.leaves(kv)),
        (1, 2), ring.cq)
    return out.astype(dtype), lse

  def step(hops, t, kv, acc):
    dtype = ring.result_dtype(hops, 0, ops.q.dtype)
    part = ring.switch(
        hops, t, functools.partial(run, dtype),
        lambda kv, at: empty(dtype, spec.seq_q, *jax.tree.leaves(kv)), kv, hops[0] + t)
    # The accumulator is fp32 from the first hop on (a scan carries it).
    return (part[0].astype(f32), part[1]) if acc is None else _merge(acc, part)

  # Hop 0 runs before any scan, so its result starts the accumulator.
  out, lse = ring.hops(step, None, ring.kv_leaves(ops))
  if spec.num_sinks:
    out, lse = epilogue.add_sinks(out, lse, ops.sinks)
  return out.astype(ops.q.dtype), lse


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
  ring = _Ring(plan, spec, positions=ops.dropout_seed is not None)
  f32 = jnp.promote_types(ops.q.dtype, jnp.float32)
  refs = (ops.q, ops.k, do, lse)
  like = lambda x: vary_like(jnp.zeros(x.shape, f32), *refs)

  def add(acc, g, rows, size):
    """``acc`` plus ``g`` at the chunk range ``rows``."""
    g = g.astype(f32)
    if rows == ring.all:
      return acc + g
    return acc.at[:, rows[0] * size:rows[1] * size].add(g)

  def zeros(x, dtype, keys):
    return vary_like(jnp.zeros(x.shape[:1] + (keys,) + x.shape[2:], dtype), *refs)

  def run(dtype, calls, kv, at, dq, dbias):
    """dq and dbias with this hop's parts added, and the dK/dV of the block
    (``dtype``: ``_Ring.result_dtype``)."""
    dkv = []
    for rows, keys, band in calls:
      sub, hs = ring.operands(ops, kv, at, rows, keys), hop_spec(spec, band)
      _, bwd, config = kernel(rows_lib.materialize(sub), hs)
      window = lambda x: ring.q_rows(rows_lib.Rows.of(x), rows)
      sub, o, d = call_args(bwd, sub, window(out), window(do))
      g = traced_once(bwd)(sub, hs, config, o, ring.q_rows(lse, rows, 2), d,
                           ring.q_rows(dlse, rows, 2))
      dq = add(dq, g.q, rows, ring.cq)
      dkv.append((keys, (g.k, g.v)))
      if dbias is not None:
        dbias = _add_block(dbias, g.bias.astype(f32), ring, at, rows, keys)
    dk, dv = ring.by_chunks(
        dkv, lambda a, b: (a[0].astype(f32) + b[0], a[1].astype(f32) + b[1]),
        lambda a: (zeros(ops.k, dtype, ring.ck), zeros(ops.v, dtype, ring.ck)),
        (1, 1), ring.ck)
    return dq, dk.astype(dtype), dv.astype(dtype), dbias

  def step(hops, t, kv, dq, dbias):
    dtype = ring.result_dtype(hops, 1, ops.k.dtype)
    dq, dk, dv, dbias = ring.switch(
        hops, t, functools.partial(run, dtype),
        lambda kv, at, dq, dbias: (dq, zeros(ops.k, dtype, spec.seq_k),
                                   zeros(ops.v, dtype, spec.seq_k), dbias),
        kv, hops[0] + t, dq, dbias)
    return [dk, dv], dq, dbias

  # The dK/dV accumulators of a block travel one hop behind it: the message of
  # hop t carries the block of hop t + 1 and the accumulators of the block of hop
  # t - 1, which the next device holds now and adds to after its kernels; one
  # message per hop, sent before the hop's kernels. The own block (hop 0) comes
  # last, so the accumulators that come home run beside its kernels: with the own
  # block first, their 344 us transfer (fp32 dK/dV, 8k rows per GPU, two H200s,
  # 2026-11-26) ran after the last kernel. The block of hop 1 is the one the
  # forward's first hop sent; under one jit XLA sends it once for both (which
  # keeps that block alive from the forward to the backward).
  n, own = ring.n, ring.kv_leaves(ops)
  dq, dbias = like(ops.q), None if ops.bias is None else like(ops.bias)
  if n == 1:
    (dk, dv), dq, dbias = step([0], 0, ring.kv_triple(own), dq, dbias)
  else:
    kv_packet = Packet.of(own)
    acc_packet = Packet((ops.k.shape, ops.v.shape), (jnp.dtype(f32),) * 2)
    both = Packet(kv_packet.shapes + acc_packet.shapes,
                  kv_packet.dtypes + acc_packet.dtypes)
    buf, m = ring.rotate(kv_packet.pack(own)), len(own)
    kv, sent = kv_packet.unpack(buf, rows=True), ring.rotate(buf) if n > 2 else None
    acc, dq, dbias = step([1], 0, ring.kv_triple(kv), dq, dbias)
    if n > 2:
      kv, mid = kv_packet.unpack(sent, rows=True), list(range(2, n - 1))
      if mid:
        def body(carry, t):
          msg, dq, dbias = carry
          sent = ring.rotate(msg)
          g, dq, dbias = step(mid, t, ring.kv_triple(both.unpack(msg, rows=True)[:m]),
                              dq, dbias)
          got = both.unpack(sent)
          return (both.pack(got[:m] + [x + y for x, y in zip(got[m:], g)]),
                  dq, dbias), None
        (msg, dq, dbias), _ = jax.lax.scan(body, (both.pack(kv + acc), dq, dbias),
                                           jnp.arange(len(mid)))
        # Windows only where K/V share the accumulators' dtype (fp32 inputs);
        # else the message's unit is an unsigned int and K/V are sliced out.
        leaves = both.unpack(msg, rows=True)
        kv, acc = leaves[:m], leaves[m:]
      sent = ring.rotate(acc_packet.pack(acc))
      g, dq, dbias = step([n - 1], 0, ring.kv_triple(kv), dq, dbias)
      acc = [x + y for x, y in zip(acc_packet.unpack(sent), g)]
    sent = ring.rotate(acc_packet.pack(acc))
    g, dq, dbias = step([0], 0, ring.kv_triple(own), dq, dbias)
    dk, dv = (x + y for x, y in zip(acc_packet.unpack(sent), g))

  dsinks = None
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, epilogue.delta(out, do, dlse))
    dsinks = _replicated_sum(dsinks, ops.sinks)
  if dbias is not None:
    if ops.bias.shape[2] == 1:  # one bias row for all rows of the ring
      dbias = _replicated_sum(dbias, ops.bias)
    dbias = dbias.astype(ops.bias.dtype)
  return Operands(q=dq.astype(ops.q.dtype), k=dk.astype(ops.k.dtype),
                  v=dv.astype(ops.v.dtype),
                  bias=dbias, sinks=dsinks)


def _add_block(dbias, g, ring: _Ring, hop, rows, keys):
  """``dbias`` plus a call's block ``g`` at its rows and columns."""
  starts = [0, 0, rows[0] * ring.cq if dbias.shape[2] > 1 else 0,
            ring.key_start(hop, keys) if dbias.shape[3] > 1 else 0]
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
