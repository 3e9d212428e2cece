"""Per-shard execution of kernel platforms under ``jit`` with sharded inputs.

XLA's partitioner cannot split a Pallas kernel (a custom call), so without help it
gathers sharded inputs and runs the whole problem on every device. Here the
platform's forward and backward are wrapped in ``custom_partitioning``: the sharding
rule tells the partitioner that batch and heads are independent, and the partition
callback runs the kernel on each device's shard with a spec of local sizes.

Sequence and head-dim axes are never split (attention needs whole rows): inputs
sharded there are gathered along those axes, which is correct, only slower. The head
axis is split only when the number of head shards divides the kv head count, so each
shard keeps whole query groups (q head h reads kv head h // G).
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
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from . import dropout as dropout_lib
from .spec import AttentionSpec, Operands


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _plan(mesh, spec: AttentionSpec, q_sharding):
  """``(batch_axes, head_axes)`` of the mesh that split q's batch and head dims."""
  pspec = getattr(q_sharding, "spec", None)
  if pspec is None:
    return (), ()
  pspec = tuple(pspec) + (None,) * (4 - len(tuple(pspec)))
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  b_axes, h_axes = _axes(pspec[0]), _axes(pspec[2])
  if spec.batch % size(b_axes):
    b_axes = ()
  if spec.heads_kv % size(h_axes):
    h_axes = ()
  return b_axes, h_axes


def _local_spec(spec: AttentionSpec, nb: int, nh: int) -> AttentionSpec:
  def local4(shape):
    if shape is None:
      return None
    bb, hb, sq, sk = shape
    return (bb // nb if bb > 1 else 1, hb // nh if hb > 1 else 1, sq, sk)
  return dataclasses.replace(spec, batch=spec.batch // nb, heads_q=spec.heads_q // nh,
                             heads_kv=spec.heads_kv // nh,
                             bias_shape=local4(spec.bias_shape),
                             mask_shape=local4(spec.mask_shape))


GRAD_FIELDS = ("q", "k", "v", "bias", "sinks")  # operands with cotangents


def _present(ops_struct: Operands) -> list[str]:
  return [n for n, x in zip(Operands._fields, ops_struct) if x is not None]


def _operand_pspecs(spec: AttentionSpec, ops: Operands, b, h) -> list:
  """PartitionSpec of each present operand, in ``Operands`` order."""
  bs, hs = b or None, h or None

  def four(shape):
    return P(bs if shape[0] > 1 else None, hs if shape[1] > 1 else None, None, None)

  row = P(bs, None, hs, None)
  specs = {"q": row, "k": row, "v": row,
           "bias": four(spec.bias_shape) if ops.bias is not None else None,
           "mask": four(spec.mask_shape) if ops.mask is not None else None,
           "q_segment_ids": P(bs, None), "kv_segment_ids": P(bs, None),
           "sinks": P(hs, None), "dropout_seed": P()}
  return [specs[n] for n in _present(ops)]


def _shardings(kind, spec, ops_struct, b, h):
  """``(argument pspecs, result pspecs)`` of one direction's call. The backward
  takes the operands then ``out, lse, do, dlse`` and returns the present
  operands' cotangents."""
  ops_p = _operand_pspecs(spec, ops_struct, b, h)
  row, lse = P(b or None, None, h or None, None), P(b or None, h or None, None)
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
  factor with kv heads: the partition gathers those (``_plan``), and a shared
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
    b, h = _plan(mesh, spec, arg_shapes[0].sharding)
    local = _local_spec(spec, math.prod(mesh.shape[a] for a in b),
                        math.prod(mesh.shape[a] for a in h))
    arg_p, res_p = _shardings(kind, spec, ops_struct, b, h)

    def lower(*args):
      if spec.dropout_rate > 0:
        args = _with_shard_seed(ops_struct, args, b, h, local)
      if kind == "fwd":
        return fn(_unflatten(ops_struct, args), local, config)
      grads = _grads(fn, ops_struct, args, local, config)
      names = [n for n in _present(ops_struct) if n in GRAD_FIELDS]
      out = []
      for n, g in zip(names, grads):
        # Cotangents of operands broadcast over a split axis are partial sums.
        if n == "bias":
          shape = spec.bias_shape
          axes = (b if shape[0] == 1 else ()) + (h if shape[1] == 1 else ())
          g = jax.lax.psum(g, axes) if axes else g
        elif n == "sinks" and b:
          g = jax.lax.psum(g, b)
        out.append(g)
      return tuple(out)

    return mesh, lower, _named(mesh, res_p), _named(mesh, arg_p)

  def infer(static, mesh, arg_shapes, result_shape):
    _, spec, _, ops_struct = static
    b, h = _plan(mesh, spec, arg_shapes[0].sharding)
    return _named(mesh, _shardings(kind, spec, ops_struct, b, h)[1])

  wrapped.def_partition(
      partition=partition, infer_sharding_from_operands=infer,
      sharding_rule=functools.partial(_sharding_rule, kind))
  return wrapped


def _with_shard_seed(ops_struct, args, b_axes, h_axes, local: AttentionSpec):
  """``args`` with the seed replaced by this shard's ``shard_seed``."""
  index = lambda axes, size: jax.lax.axis_index(axes) * size if axes else 0
  n = _present(ops_struct).index("dropout_seed")
  seed = dropout_lib.shard_seed(args[n], index(b_axes, local.batch),
                                index(h_axes, local.heads_q))
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
