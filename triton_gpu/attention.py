"""The triton_gpu platform: Triton kernels (kernels.py) called through jax-triton.

Imported only when the platform runs, so ``import flashjax`` never imports triton.
Environment variables of jax-flash-attn2 (the seed this platform replaces):

* ``CACHE_TRITON_KERNELS=1``: keep Triton's on-disk kernel cache (jax-triton turns
  it off at import); the folder is ``$TRITON_CACHE_DIR`` if set before import, else
  ``~/.triton/cache``.
* ``_JAX_TRITON_DUMP_DIR=path``: jax-triton writes each compiled kernel there.
* ``BLOCKSIZE_M_FLASH_ATTN`` / ``BLOCKSIZE_N_FLASH_ATTN``: forward tile sizes.
* ``GPU_IDX_FLASH_ATTN=i``: compile for device i's compute capability.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from ..common import dropout as dropout_lib
from ..common import epilogue, hardware, platform, vjp
from ..common import spec as spec_lib
from ..common.blocking import pad_axis, pad_broadcastable
from . import plan
from .plan import Geometry, KernelsConfig, default_config

_cache_dir = os.environ.get("TRITON_CACHE_DIR")
import jax_triton as jt  # noqa: E402  (sets TRITON_CACHE_DIR="" on import)
from jax_triton import triton_lib  # noqa: E402

from . import kernels  # noqa: E402

if os.environ.get("CACHE_TRITON_KERNELS", "").lower() in ("1", "true", "yes", "on"):
  os.environ["TRITON_CACHE_DIR"] = _cache_dir or os.path.expanduser("~/.triton/cache")
if os.environ.get("_JAX_TRITON_DUMP_DIR"):
  triton_lib._JAX_TRITON_DUMP_DIR = os.environ["_JAX_TRITON_DUMP_DIR"]


def _compute_capability():
  idx = os.environ.get("GPU_IDX_FLASH_ATTN")
  if idx is None:
    return None
  major, minor = hardware.compute_capability(jax.devices("gpu")[int(idx)])
  return major * 10 + minor


@dataclasses.dataclass(frozen=True)
class _Inputs:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  q_ids: jax.Array | None  # int32, padded
  kv_ids: jax.Array | None
  bias: jax.Array | None  # fp32, padded where not broadcast
  mask: jax.Array | None  # int8, same
  seed: jax.Array | None  # int32 [8] (dropout_lib.kernel_seed, positions=True)

  def pointers(self):
    """The optional operands as the kernels take them: a dummy stands in for an
    absent one (its HAS_ flag is off, so it is never read)."""
    dummy = jnp.zeros((1,), jnp.int32)
    return tuple(dummy if x is None else x
                 for x in (self.q_ids, self.kv_ids, self.bias, self.mask, self.seed))


def _constexprs(spec, geo: Geometry, bm: int, bn: int, config, x: _Inputs):
  shape = lambda a: None if a is None else a.shape
  return plan.constexprs(spec, geo, bm, bn, config, shape(x.bias), shape(x.mask))


def _prepare(ops, spec, geo: Geometry) -> _Inputs:
  pad = lambda x, s, d: pad_axis(pad_axis(x, 1, s), 3, d)
  pad_seq = lambda x: pad_broadcastable(x, geo.seq_q_padded, geo.seq_k_padded)
  q = pad(ops.q, geo.seq_q_padded, geo.head_dim_padded)
  k = pad(ops.k, geo.seq_k_padded, geo.head_dim_padded)
  v = pad(ops.v, geo.seq_k_padded, geo.head_dim_v_padded)
  q_ids = kv_ids = None
  if ops.q_segment_ids is not None:
    q_ids = pad_axis(ops.q_segment_ids, 1, geo.seq_q_padded)
    kv_ids = pad_axis(ops.kv_segment_ids, 1, geo.seq_k_padded)
  bias = None if ops.bias is None else pad_seq(ops.bias.astype(jnp.float32))
  mask = None if ops.mask is None else pad_seq(ops.mask.astype(jnp.int8))
  seed = None if ops.dropout_seed is None else dropout_lib.kernel_seed(
      ops.dropout_seed, positions=True)
  return _Inputs(q, k, v, q_ids, kv_ids, bias, mask, seed)


def _table(ops, geo: Geometry, bm: int, bn: int, over_kv: bool):
  ids = None if ops.q_segment_ids is None else (ops.q_segment_ids,
                                                ops.kv_segment_ids)
  return jnp.asarray(geo.block_table(bm, bn, over_kv, ids))


def forward(ops, spec, static: platform.Static):
  cfg = static.config
  geo = Geometry.of(spec, cfg)
  x = _prepare(ops, spec, geo)
  bm, bn = cfg.fwd.block_q, cfg.fwd.block_kv
  table = _table(ops, geo, bm, bn, over_kv=True)
  out, lse = jt.triton_call(
      x.q, x.k, x.v, *x.pointers(), table, kernel=kernels.fwd_kernel,
      out_shape=[jax.ShapeDtypeStruct((spec.batch, geo.seq_q_padded, spec.heads_q,
                                       geo.head_dim_v_padded), x.q.dtype),
                 jax.ShapeDtypeStruct((spec.batch, spec.heads_q, geo.seq_q_padded),
                                      jnp.float32)],
      grid=(geo.seq_q_padded // bm, spec.batch * spec.heads_q),
      num_warps=cfg.fwd.num_warps, num_stages=cfg.fwd.num_stages,
      compute_capability=_compute_capability(), name="flashjax_triton_fwd",
      **_constexprs(spec, geo, bm, bn, cfg, x))
  return epilogue.finish_forward(out, lse, spec, ops.sinks)


def backward(ops, spec, static: platform.Static, out, lse, do, dlse):
  cfg = static.config
  geo = Geometry.of(spec, cfg)
  x = _prepare(ops, spec, geo)
  sqp, skp = geo.seq_q_padded, geo.seq_k_padded
  row_delta, lse_rows, delta_rows = epilogue.backward_rows(out, do, dlse, lse, sqp)
  do_p = pad_axis(pad_axis(do.astype(x.q.dtype), 1, sqp), 3, geo.head_dim_v_padded)
  common = (x.q, x.k, x.v, do_p, lse_rows, delta_rows) + x.pointers()
  cc = _compute_capability()

  bm, bn = cfg.dq.block_q, cfg.dq.block_kv
  # With a bias the dq kernel also writes ds (zeroed first: skipped blocks stay 0).
  ds_shape = (spec.batch, spec.heads_q, sqp, skp) if x.bias is not None else (1,)
  dq, ds = jt.triton_call(
      *common, _table(ops, geo, bm, bn, over_kv=True),
      kernel=kernels.dq_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.q.shape, x.q.dtype),
                 jax.ShapeDtypeStruct(ds_shape, jnp.float32)],
      zeroed_outputs=(1,) if x.bias is not None else (),
      grid=(sqp // bm, spec.batch * spec.heads_q), num_warps=cfg.dq.num_warps,
      num_stages=cfg.dq.num_stages, compute_capability=cc, name="flashjax_triton_dq",
      **_constexprs(spec, geo, bm, bn, cfg, x))

  bm, bn = cfg.dkv.block_q, cfg.dkv.block_kv
  dk, dv = jt.triton_call(
      *common, _table(ops, geo, bm, bn, over_kv=False),
      kernel=kernels.dkv_kernel,
      out_shape=[jax.ShapeDtypeStruct(x.k.shape, x.k.dtype),
                 jax.ShapeDtypeStruct(x.v.shape, x.v.dtype)],
      grid=(skp // bn, spec.batch * spec.heads_kv),
      num_warps=cfg.dkv.num_warps, num_stages=cfg.dkv.num_stages,
      compute_capability=cc, name="flashjax_triton_dkv",
      **_constexprs(spec, geo, bm, bn, cfg, x))
  dsinks = epilogue.sinks_grad(ops.sinks, lse, row_delta) if spec.num_sinks else None
  dbias = None if x.bias is None else epilogue.dbias_from_ds(ds, spec, ops.bias)
  return spec_lib.Operands(
      q=dq[:, :spec.seq_q, :, :spec.head_dim],
      k=dk[:, :spec.seq_k, :, :spec.head_dim],
      v=dv[:, :spec.seq_k, :, :spec.head_dim_v], bias=dbias, sinks=dsinks)


def attention_from_operands(ops, spec, config: KernelsConfig | None = None):
  if jax.default_backend() != "gpu":
    raise NotImplementedError("needs a GPU (Triton kernels through jax-triton)")
  config = platform.check_config(config or default_config(spec), KernelsConfig,
                                 "triton")
  return vjp.attention(forward, backward, ops, spec, platform.Static(config),
                       per_shard=True)
