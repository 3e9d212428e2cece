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
elements, the sinks) are summed over that axis's devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

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


def _operand_pspecs(spec: AttentionSpec, ops: Operands, b, h) -> Operands:
  """PartitionSpec of each present operand (a pytree like ``ops``)."""
  bs = b or None
  hs = h or None

  def four(shape):
    return P(bs if shape[0] > 1 else None, hs if shape[1] > 1 else None, None, None)

  return Operands(
      q=P(bs, None, hs, None), k=P(bs, None, hs, None), v=P(bs, None, hs, None),
      bias=None if ops.bias is None else four(spec.bias_shape),
      mask=None if ops.mask is None else four(spec.mask_shape),
      q_segment_ids=None if ops.q_segment_ids is None else P(bs, None),
      kv_segment_ids=None if ops.kv_segment_ids is None else P(bs, None),
      sinks=None if ops.sinks is None else P(hs, None),
      dropout_seed=None if ops.dropout_seed is None else P())


def _named(mesh, tree):
  return jax.tree.map(lambda p: NamedSharding(mesh, p), tree,
                      is_leaf=lambda x: isinstance(x, P))


def _rule(spec: AttentionSpec, ops: Operands, outputs: str) -> tuple[str, dict]:
  """Einsum-like Shardy rule: batch ``b``, kv heads ``k`` and group ``g`` are
  shared factors; every other dim gets a factor of its own."""
  fresh = iter(f"z{i}" for i in range(64))
  heads = "(k g)" if spec.group_size > 1 else "k"

  def four(shape):
    bb, hb = shape[:2]
    return " ".join(["b" if bb > 1 else next(fresh), heads if hb > 1 else next(fresh),
                     next(fresh), next(fresh)])

  q = f"b s {heads} d"
  terms = {"q": q, "k": "b t k d", "v": "b t k e",
           "bias": four(spec.bias_shape) if ops.bias is not None else None,
           "mask": four(spec.mask_shape) if ops.mask is not None else None,
           "q_segment_ids": "b s", "kv_segment_ids": "b t",
           "sinks": f"{heads} n", "dropout_seed": ""}
  ins = [terms[name] for name, x in zip(Operands._fields, ops) if x is not None]
  outs = {"fwd": [f"b s {heads} e", f"b {heads} s"],
          "bwd": []}[outputs]
  return ", ".join(ins), outs


def _sharding_rule(kind, static, mesh, value_types, result_types):
  spec, ops_struct = static[1], static[-1]
  ins, outs = _rule(spec, ops_struct, "fwd")
  factors = {"g": spec.group_size} if spec.group_size > 1 else {}
  if kind == "fwd":
    return f"{ins} -> {', '.join(outs)}", factors
  # backward operands: ops..., out, lse, do, dlse; results: the present grads.
  heads = "(k g)" if spec.group_size > 1 else "k"
  extra = [f"b s {heads} e", f"b {heads} s", f"b s {heads} e", f"b {heads} s"]
  grads = []
  terms = [t.strip() for t in ins.split(",")]
  present = [n for n, x in zip(Operands._fields, ops_struct) if x is not None]
  for name, term in zip(present, terms):
    if name in ("q", "k", "v", "bias", "sinks"):
      grads.append(term)
  return f"{ins}, {', '.join(extra)} -> {', '.join(grads)}", factors


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
    nb = math.prod(mesh.shape[a] for a in b)
    nh = math.prod(mesh.shape[a] for a in h)
    local = _local_spec(spec, nb, nh)
    op_p = _operand_pspecs(spec, ops_struct, b, h)
    op_flat = [p for p in jax.tree.leaves(op_p, is_leaf=lambda x: isinstance(x, P))]
    row = P(b or None, None, h or None, None)
    lse = P(b or None, h or None, None)
    if kind == "fwd":
      arg_p = op_flat
      res_p = (row, lse)

      def lower(*args):
        ops = _unflatten(static, args, kind)
        return fn(ops, local, config)
    else:
      arg_p = op_flat + [row, lse, row, lse]
      present = [n for n, x in zip(Operands._fields, ops_struct) if x is not None]
      res_p = tuple(p for n, p in zip(present, op_flat)
                    if n in ("q", "k", "v", "bias", "sinks"))

      def lower(*args):
        grads = _grads(fn, static, args, local, config)
        out = []
        for n, g in zip([n for n in present if n in ("q", "k", "v", "bias", "sinks")],
                        grads):
          if n == "bias":
            # A bias broadcast over a split axis got partial sums on each device.
            shape = spec.bias_shape
            axes = (b if shape[0] == 1 else ()) + (h if shape[1] == 1 else ())
            g = jax.lax.psum(g, axes) if axes else g
          elif n == "sinks" and b:
            g = jax.lax.psum(g, b)
          out.append(g)
        return tuple(out)
    return mesh, lower, _named(mesh, res_p), _named(mesh, tuple(arg_p))

  wrapped.def_partition(
      partition=partition,
      infer_sharding_from_operands=_infer(kind),
      sharding_rule=functools.partial(_sharding_rule, kind))
  return wrapped


def _run(kind, static, *args):
  fn, spec, config, _ = static
  if kind == "fwd":
    return fn(_unflatten(static, args, kind), spec, config)
  return _grads(fn, static, args, spec, config)


def _infer(kind):
  def infer(static, mesh, arg_shapes, result_shape):
    _, spec, _, ops_struct = static
    b, h = _plan(mesh, spec, arg_shapes[0].sharding)
    if kind == "fwd":
      return _named(mesh, (P(b or None, None, h or None, None),
                           P(b or None, h or None, None)))
    op_p = _operand_pspecs(spec, ops_struct, b, h)
    present = [n for n, x in zip(Operands._fields, ops_struct) if x is not None]
    flat = jax.tree.leaves(op_p, is_leaf=lambda x: isinstance(x, P))
    return _named(mesh, tuple(p for n, p in zip(present, flat)
                              if n in ("q", "k", "v", "bias", "sinks")))
  return infer


def _unflatten(static, args, kind):
  ops_struct = static[-1]
  n = sum(x is not None for x in ops_struct)
  it = iter(args[:n])
  return Operands(*(next(it) if x is not None else None for x in ops_struct))


def _grads(fn, static, args, spec, config):
  ops_struct = static[-1]
  n = sum(x is not None for x in ops_struct)
  ops = _unflatten(static, args, "bwd")
  out, lse, do, dlse = args[n:]
  grads = fn(ops, spec, config, out, lse, do, dlse)
  return tuple(g for name, g, x in zip(Operands._fields, grads, ops_struct)
               if x is not None and name in ("q", "k", "v", "bias", "sinks"))


def _struct(ops: Operands) -> Operands:
  """Hashable presence marker of each operand (True/None)."""
  return Operands(*(None if x is None else True for x in ops))


def enabled(spec: AttentionSpec) -> bool:
  # The dropout hash takes global batch and head indices, which a shard does not
  # know; such calls are left to XLA (gathered, still exact).
  return jax.device_count() > 1 and spec.dropout_rate == 0


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
  return Operands(*(next(grads) if x is not None and name in
                    ("q", "k", "v", "bias", "sinks") else None
                    for name, x in zip(Operands._fields, ops)))
