"""Per-shard execution of the platforms under ``jit`` with sharded inputs.

XLA's partitioner cannot split a Pallas kernel (a custom call), so without help it
gathers sharded inputs and runs the whole problem on every device; the xla
platform's plain ops it splits by batch and heads, but it gathers K/V of a split
sequence. Here the platform's forward and backward are wrapped in
``custom_partitioning``: the sharding rule tells the partitioner that batch and
heads are independent, and the partition callback runs the kernel on each
device's shard with a spec of local sizes.

The head-dim axis is never split. Sequences split along one mesh axis (q's and
k's, the same axis, lengths divisible by its size) run ring attention on the
shards (common/ring.py): K/V blocks travel by collective-permute over that axis,
nothing is gathered; causal calls move their rows into the zigzag layout and back
inside the lowering (two half-shard permutes per array each way). Query rows
split along one axis with the keys whole (or split otherwise) keep their split:
K/V arrive whole and each device attends its rows to all keys, its K/V cotangents
summed over the axis. Any other sequence split is gathered, which is correct,
only slower. The head axis is split when the number of head shards divides the
kv head count, so each shard keeps whole query groups (q head h reads kv head
h // G), or when each shard's query heads lie in one group (MQA, or GQA with
fewer kv heads than shards, sequences whole): then K/V heads are whole on every
device, each shard slices its kv head, and K/V cotangents are summed over the
head axes.
Cotangents of operands broadcast over a split axis (a bias shared by all batch
elements, the sinks) are summed over that axis's devices. The dropout hash takes
global batch and head indices: each shard passes its offsets to the kernels with
the seed (``dropout.shard_seed``), so a split call drops exactly what the whole
call would.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.custom_batching
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from . import dropout as dropout_lib
from . import epilogue
from . import ring as ring_lib
from .compat import vary_like
from .spec import AttentionSpec, Operands


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _pspec4(sharding) -> tuple | None:
  pspec = getattr(sharding, "spec", None)
  if pspec is None:
    return None
  return tuple(pspec) + (None,) * (4 - len(tuple(pspec)))


def _plan(mesh, spec: AttentionSpec, arg_shapes):
  """``(batch_axes, head_axes, seq_axis, kv_split, one_kv_head)`` of the mesh: the
  axes that split q's batch and head dims, and the one that splits q's rows (None
  where they stay whole); ``kv_split``: k's rows too, by the same axis (the
  ring), else K/V rows are whole on every device; ``one_kv_head``: each head
  shard's query heads read one kv head, K/V heads whole on every device."""
  pq = _pspec4(arg_shapes[0].sharding)
  if pq is None:
    return (), (), None, False, False
  pk = _pspec4(arg_shapes[1].sharding) or (None,) * 4
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  seq = _axes(pq[1])
  rows = (len(seq) == 1 and mesh.shape[seq[0]] > 1
          and spec.seq_q % mesh.shape[seq[0]] == 0)
  ring = rows and _axes(pk[1]) == seq and spec.seq_k % mesh.shape[seq[0]] == 0
  seq_axis = seq[0] if rows else None
  b_axes = tuple(a for a in _axes(pq[0]) if a != seq_axis)
  h_axes = tuple(a for a in _axes(pq[2]) if a != seq_axis)
  if spec.batch % size(b_axes):
    b_axes = ()
  nh = size(h_axes)
  one_kv_head = (spec.heads_kv % nh != 0 and spec.heads_q % nh == 0
                 and spec.group_size % (spec.heads_q // nh) == 0 and seq_axis is None)
  if spec.heads_kv % nh and not one_kv_head:
    h_axes = ()
  return b_axes, h_axes, seq_axis, ring, one_kv_head


def _local_spec(spec: AttentionSpec, nb: int, nh: int, ns: int = 1,
                kv_split: bool = True, one_kv_head: bool = False) -> AttentionSpec:
  """Shard sizes; ``ns`` shards split q's rows (and k's where ``kv_split``) and
  the rows of a bias or mask (its columns stay whole: the ring slices each hop's
  keys)."""
  def local4(shape):
    if shape is None:
      return None
    bb, hb, sq, sk = shape
    return (bb // nb if bb > 1 else 1, hb // nh if hb > 1 else 1,
            sq // ns if sq > 1 else 1, sk)
  return dataclasses.replace(spec, batch=spec.batch // nb, heads_q=spec.heads_q // nh,
                             heads_kv=1 if one_kv_head else spec.heads_kv // nh,
                             seq_q=spec.seq_q // ns,
                             seq_k=spec.seq_k // ns if kv_split else spec.seq_k,
                             bias_shape=local4(spec.bias_shape),
                             mask_shape=local4(spec.mask_shape))


GRAD_FIELDS = ("q", "k", "v", "bias", "sinks")  # operands with cotangents


def _present(ops_struct: Operands) -> list[str]:
  return [n for n, x in zip(Operands._fields, ops_struct) if x is not None]


def _operand_pspecs(spec: AttentionSpec, ops: Operands, b, h, s=None,
                    kv_split: bool = True, one_kv_head: bool = False) -> list:
  """PartitionSpec of each present operand, in ``Operands`` order; ``s`` splits
  q's rows (k's too where ``kv_split``) and a bias/mask's rows; ``h`` splits the
  kv heads unless ``one_kv_head``."""
  bs, hs = b or None, h or None
  ks = s if kv_split else None
  khs = None if one_kv_head else hs

  def four(shape):
    return P(bs if shape[0] > 1 else None, hs if shape[1] > 1 else None,
             s if shape[2] > 1 else None, None)

  row, kv = P(bs, s, hs, None), P(bs, ks, khs, None)
  specs = {"q": row, "k": kv, "v": kv,
           "bias": four(spec.bias_shape) if ops.bias is not None else None,
           "mask": four(spec.mask_shape) if ops.mask is not None else None,
           "q_segment_ids": P(bs, s), "kv_segment_ids": P(bs, ks),
           "sinks": P(hs, None), "dropout_seed": P()}
  return [specs[n] for n in _present(ops)]


def _shardings(kind, spec, ops_struct, b, h, s=None, kv_split=True,
               one_kv_head=False):
  """``(argument pspecs, result pspecs)`` of one direction's call. The backward
  takes the operands then ``out, lse, do, dlse`` and returns the present
  operands' cotangents."""
  ops_p = _operand_pspecs(spec, ops_struct, b, h, s, kv_split, one_kv_head)
  row, lse = P(b or None, s, h or None, None), P(b or None, h or None, s)
  if kind == "fwd":
    return ops_p, [row, lse]
  grads = [p for n, p in zip(_present(ops_struct), ops_p) if n in GRAD_FIELDS]
  return ops_p + [row, lse, row, lse], grads


def _named(mesh, pspecs):
  return tuple(NamedSharding(mesh, p) for p in pspecs)


def _head_factors(spec: AttentionSpec, devices: int) -> tuple[str, str | None]:
  """Shardy terms of the query and kv head dims: kv heads ``k`` times the group
  ``g``. A factor of size 1 may not join a compound dim, so MHA is ``k`` alone and
  MQA is ``g`` alone, its kv head dim (None) a factor of its own. Where some split
  of the ``devices`` would not divide the kv heads, query heads ``h`` share no
  factor with kv heads: the partition gathers those or gives each shard its one
  kv head (``_plan``), and a shared
  factor would let propagation hand it kv heads split over part of a mesh axis,
  which it cannot take (Hkv = 2 over 4 devices)."""
  if spec.group_size == 1:
    return "k", "k"
  if spec.heads_kv == 1:
    return "g", None
  if spec.heads_kv % devices:
    return "h", None
  return "(k g)", "k"


def _terms(spec: AttentionSpec, ops: Operands, devices: int) -> list[str]:
  """Einsum-like Shardy terms of the present operands: batch ``b``, kv heads ``k``
  and group ``g`` are shared factors; every other dim gets a factor of its own."""
  fresh = iter(f"z{i}" for i in range(64))
  heads, kv_heads = _head_factors(spec, devices)
  kv = lambda: kv_heads or next(fresh)

  def four(shape):
    bb, hb = shape[:2]
    return " ".join(["b" if bb > 1 else next(fresh), heads if hb > 1 else next(fresh),
                     next(fresh), next(fresh)])

  terms = {"q": f"b s {heads} d", "k": f"b t {kv()} d", "v": f"b t {kv()} e",
           "bias": four(spec.bias_shape) if ops.bias is not None else None,
           "mask": four(spec.mask_shape) if ops.mask is not None else None,
           "q_segment_ids": "b s", "kv_segment_ids": "b t",
           "sinks": f"{heads} n", "dropout_seed": ""}
  return [terms[n] for n in _present(ops)]


def _sharding_rule(kind, static, mesh, value_types, result_types):
  _, spec, _, ops_struct = static
  devices = math.prod(mesh.shape.values())
  ins = _terms(spec, ops_struct, devices)
  heads, _ = _head_factors(spec, devices)
  factors = {"g": spec.group_size} if heads == "(k g)" else {}
  row, lse = f"b s {heads} e", f"b {heads} s"
  if kind == "fwd":
    return f"{', '.join(ins)} -> {row}, {lse}", factors
  grads = [t for n, t in zip(_present(ops_struct), ins) if n in GRAD_FIELDS]
  return (f"{', '.join(ins + [row, lse, row, lse])} -> {', '.join(grads)}", factors)


@functools.lru_cache(maxsize=None)
def _wrapped(kind: str):
  """One ``custom_partitioning`` per direction; everything static rides in
  ``static = (fn, spec, config, ops_struct)``."""

  def call(static, *args):
    # Under jit, array constants the kernels build at trace time (block tables)
    # stay inside the inner computation; custom_partitioning allows none outside.
    return jax.jit(functools.partial(_run, kind, static))(*args)

  wrapped = custom_partitioning(call, static_argnums=(0,))

  def partition(static, mesh, arg_shapes, result_shape):
    fn, spec, config, ops_struct = static
    b, h, s, kv_split, one_kv_head = _plan(mesh, spec, arg_shapes)
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    local = _local_spec(spec, size(b), size(h), mesh.shape[s] if s else 1, kv_split,
                        one_kv_head)
    arg_p, res_p = _shardings(kind, spec, ops_struct, b, h, s, kv_split, one_kv_head)
    if s is not None:
      lower = functools.partial(_ring_lower if kv_split else _rows_lower, kind,
                                static, local, b, h, s, mesh.shape[s])
      return mesh, lower, _named(mesh, res_p), _named(mesh, arg_p)

    def lower(*args):
      if spec.dropout_rate > 0:
        args = _with_shard_seed(ops_struct, args, b, h, local)
      if one_kv_head:  # this head shard's kv head (q head h reads kv head h // G)
        kv_head = jax.lax.axis_index(h) * local.heads_q // spec.group_size
        args = _kv_heads(ops_struct, args, lambda x: jax.lax.dynamic_slice_in_dim(
            x, kv_head, 1, 2))
      if kind == "fwd":
        return fn(_unflatten(ops_struct, args), local, config)
      grads = _grads(fn, ops_struct, args, local, config)
      names = [n for n in _present(ops_struct) if n in GRAD_FIELDS]
      if one_kv_head:  # each shard's part of its kv head, summed over the shards
        grads = [_psum(jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros(g.shape[:2] + (spec.heads_kv,) + g.shape[3:], g.dtype), g,
            kv_head, 2), h) if n in ("k", "v") else g for n, g in zip(names, grads)]
      return tuple(_summed(n, g, spec, b, h) for n, g in zip(names, grads))

    return mesh, lower, _named(mesh, res_p), _named(mesh, arg_p)

  def infer(static, mesh, arg_shapes, result_shape):
    _, spec, _, ops_struct = static
    return _named(mesh, _shardings(kind, spec, ops_struct,
                                   *_plan(mesh, spec, arg_shapes))[1])

  wrapped.def_partition(
      partition=partition, infer_sharding_from_operands=infer,
      sharding_rule=functools.partial(_sharding_rule, kind))
  return wrapped


def _ring_lower(kind, static, local: AttentionSpec, b_axes, h_axes, axis, n, *args):
  """One direction of ring attention on this device's shards (``local`` sizes),
  the ring running over the mesh axis ``axis`` of ``n`` devices. Causal calls
  with equal lengths run in the zigzag layout (equal work per device), their rows
  moved there and back by ``ring.to_zigzag`` / ``from_zigzag``."""
  fn, spec, config, ops_struct = static
  zigzag = spec.causal and spec.seq_q == spec.seq_k and local.seq_q % 2 == 0
  plan = ring_lib.RingPlan(axis_name=axis, num_shards=n,
                           layout="zigzag" if zigzag else "contiguous",
                           band=spec.band, batch_axes=b_axes, head_axes=h_axes)
  fwd, bwd = (fn, None) if kind == "fwd" else (None, fn)
  kernel = ring_lib.FixedKernel(fwd, bwd, config)
  count = len(_present(ops_struct))
  ops = _unflatten(ops_struct, args[:count])
  to = (lambda x, dim=1: ring_lib.to_zigzag(x, axis, dim)) if zigzag else (
      lambda x, dim=1: x)
  back = (lambda x, dim=1: ring_lib.from_zigzag(x, axis, dim)) if zigzag else (
      lambda x, dim=1: x)

  def dense(x, inverse=False):
    """A bias/mask block in the layout: rows moved, whole columns reordered."""
    if x is None or not zigzag:
      return x
    if x.shape[2] > 1:
      x = (back if inverse else to)(x, 2)
    if x.shape[3] > 1:
      x = (ring_lib.zigzag_restore if inverse else ring_lib.zigzag_order)(x, n, 3)
    return x

  ids = lambda x: None if x is None else to(x)
  ops = ops._replace(q=to(ops.q), k=to(ops.k), v=to(ops.v), bias=dense(ops.bias),
                     mask=dense(ops.mask), q_segment_ids=ids(ops.q_segment_ids),
                     kv_segment_ids=ids(ops.kv_segment_ids))
  ring_lib.check_local_shapes(plan, local)
  if kind == "fwd":
    out, lse = ring_lib.forward(kernel, plan, ops, local)
    return back(out), back(lse, 2)
  out, lse, do, dlse = args[count:]
  grads = ring_lib.backward(kernel, plan, ops, local, to(out), to(lse, 2), to(do),
                            to(dlse, 2))
  result = []
  for name in _present(ops_struct):
    if name not in GRAD_FIELDS:
      continue
    g = getattr(grads, name)
    if name in ("q", "k", "v"):
      g = back(g)
    elif name == "bias":
      g = dense(g, inverse=True)
    result.append(_summed(name, g, spec, b_axes, h_axes, axis))
  return tuple(result)


def _rows_lower(kind, static, local: AttentionSpec, b_axes, h_axes, axis, n, *args):
  """One direction on this device's query rows against all keys (q's rows split
  along ``axis`` of ``n`` devices, K/V whole). The rows' band depends on the
  device index, a traced value: the distinct static bands are the branches of a
  ``lax.switch``; rows that reach no key take a branch that runs no kernel."""
  fn, spec, config, ops_struct = static
  count = len(_present(ops_struct))
  ops = _unflatten(ops_struct, args[:count])
  r = jax.lax.axis_index(axis)
  if ops.dropout_seed is not None:  # global rows, as in a ring hop
    ops = ops._replace(dropout_seed=dropout_lib.position_seed(
        ops.dropout_seed, ring_lib.shard_offset(b_axes, local.batch),
        ring_lib.shard_offset(h_axes, local.heads_q), r * local.seq_q, 0))
  bands = [spec.band.sub_block(d * local.seq_q, local.seq_q, 0, spec.seq_k)
           for d in range(n)]
  # The kernel adds the sinks itself: every row's keys are on this device.
  spec_of = lambda band: dataclasses.replace(ring_lib.hop_spec(local, band),
                                            num_sinks=local.num_sinks)
  refs = jax.tree.leaves((ops, args[count:]))
  zeros = lambda shape, dtype, fill=0.0: vary_like(
      jnp.full(shape, fill, dtype), *refs)

  if kind == "fwd":
    def empty(ops):
      acc = jnp.promote_types(ops.q.dtype, jnp.float32)
      out = zeros(ops.q.shape[:3] + (local.head_dim_v,), ops.q.dtype)
      lse = zeros((local.batch, local.heads_q, local.seq_q), acc, -jnp.inf)
      if local.num_sinks:
        out, lse = epilogue.add_sinks(out, lse, ops.sinks)
        out = out.astype(ops.q.dtype)
      return out, lse

    return ring_lib.band_switch(
        bands, r, lambda band, ops: fn(ops, spec_of(band), config), empty, ops)

  names = [n for n in _present(ops_struct) if n in GRAD_FIELDS]

  def run(band, ops, out, lse, do, dlse):
    grads = fn(ops, spec_of(band), config, out, lse, do, dlse)
    return tuple(getattr(grads, n) for n in names)

  def empty(ops, out, lse, do, dlse):
    grads = {n: zeros(getattr(ops, n).shape, getattr(ops, n).dtype) for n in names}
    if local.num_sinks:
      grads["sinks"] = epilogue.sinks_grad(ops.sinks, lse,
                                           epilogue.delta(out, do, dlse))
    return tuple(grads[n] for n in names)

  grads = ring_lib.band_switch(bands, r, run, empty, ops, *args[count:])
  # Each device's K/V cotangents are its rows' part of the sum.
  return tuple(_psum(g, axis) if n in ("k", "v") else
               _summed(n, g, spec, b_axes, h_axes, axis)
               for n, g in zip(names, grads))


def _summed(name, g, spec: AttentionSpec, b_axes, h_axes, ring_axis=None):
  """The cotangent ``g`` of operand ``name``, summed over the split axes the
  operand is broadcast along (they hold partial sums): a bias with one batch
  element, head or (in a ring) query row for all, the sinks (shared by batch and
  rows)."""
  ring = (ring_axis,) if ring_axis else ()
  if name == "bias":
    shape = spec.bias_shape
    axes = ((b_axes if shape[0] == 1 else ()) + (h_axes if shape[1] == 1 else ()) +
            (ring if shape[2] == 1 else ()))
  elif name == "sinks":
    axes = tuple(b_axes) + ring
  else:
    axes = ()
  return _psum(g, axes) if axes else g


def _psum(g, axes):
  """``psum`` of partial cotangents in fp32 (at least), rounded once to ``g``'s
  dtype, as the ring sums its hops: bf16 partial sums would round at every add."""
  wide = jnp.promote_types(g.dtype, jnp.float32)
  return jax.lax.psum(g.astype(wide), axes).astype(g.dtype)


def _kv_heads(ops_struct, args, f):
  """``args`` with ``f`` applied to k and v."""
  names = _present(ops_struct)
  return tuple(f(x) if n in ("k", "v") else x for n, x in zip(names, args)) + tuple(
      args[len(names):])


def _with_shard_seed(ops_struct, args, b_axes, h_axes, local: AttentionSpec):
  """``args`` with the seed replaced by this shard's ``shard_seed``."""
  n = _present(ops_struct).index("dropout_seed")
  seed = dropout_lib.shard_seed(args[n], ring_lib.shard_offset(b_axes, local.batch),
                                ring_lib.shard_offset(h_axes, local.heads_q))
  return args[:n] + (seed,) + args[n + 1:]


def _run(kind, static, *args):
  fn, spec, config, ops_struct = static
  if kind == "fwd":
    return fn(_unflatten(ops_struct, args), spec, config)
  return _grads(fn, ops_struct, args, spec, config)


def _unflatten(ops_struct, args) -> Operands:
  it = iter(args)
  return Operands(*(next(it) if x is not None else None for x in ops_struct))


def _grads(fn, ops_struct, args, spec, config):
  n = len(_present(ops_struct))
  out, lse, do, dlse = args[n:]
  grads = fn(_unflatten(ops_struct, args[:n]), spec, config, out, lse, do, dlse)
  return tuple(g for name, g, x in zip(Operands._fields, grads, ops_struct)
               if x is not None and name in GRAD_FIELDS)


def _struct(ops: Operands) -> Operands:
  """Hashable presence marker of each operand (True/None)."""
  return Operands(*(None if x is None else True for x in ops))


def enabled(spec: AttentionSpec) -> bool:
  del spec
  return jax.device_count() > 1


def _call(kind, static, args):
  """The partitioned call, with a vmap rule (custom_partitioning has none): under
  vmap the platform's function is vmapped directly (its kernels batch), so
  vmapped calls are not split per shard."""

  @jax.custom_batching.custom_vmap
  def call(*args):
    return _wrapped(kind)(static, *args)

  @call.def_vmap
  def _rule(axis_size, in_batched, *args):
    del axis_size
    out = jax.vmap(functools.partial(_run, kind, static),
                   in_axes=tuple(0 if b else None for b in in_batched))(*args)
    return out, jax.tree.map(lambda _: True, out)

  return call(*args)


def forward(fn, ops: Operands, spec: AttentionSpec, config):
  """``fn(ops, spec, config)`` run per shard of batch and heads."""
  if not enabled(spec):
    return fn(ops, spec, config)
  args = [x for x in ops if x is not None]
  return _call("fwd", (fn, spec, config, _struct(ops)), args)


def backward(fn, ops: Operands, spec: AttentionSpec, config, out, lse, do, dlse):
  """``fn(ops, spec, config, out, lse, do, dlse)`` run per shard; returns
  ``Operands`` of cotangents like ``fn``."""
  if not enabled(spec):
    return fn(ops, spec, config, out, lse, do, dlse)
  args = [x for x in ops if x is not None] + [out, lse, do, dlse]
  grads = iter(_call("bwd", (fn, spec, config, _struct(ops)), args))
  return Operands(*(next(grads) if x is not None and name in GRAD_FIELDS else None
                    for name, x in zip(Operands._fields, ops)))
