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

from ..common import epilogue, vjp
from ..common import spec as spec_lib
from ..common.blocking import pad_axis
from .plan import Geometry, TritonKernelsConfig, default_config

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
  kind = jax.devices("gpu")[int(idx)]
  major, minor = kind.compute_capability.split(".")
  return int(major) * 10 + int(minor)


@dataclasses.dataclass(frozen=True)
class _Static:
  config: TritonKernelsConfig


def _constexprs(spec, geo: Geometry, bm: int, bn: int, config):
  band = spec.band
  return dict(
      SQ=geo.seq_q_padded, SK=geo.seq_k_padded, HQ=spec.heads_q, HKV=spec.heads_kv,
      D=geo.head_dim_padded, DV=geo.head_dim_v_padded, BM=bm, BN=bn,
      SEQ_K=spec.seq_k, SCALE=float(spec.softmax_scale),
      CAP=float(spec.logits_soft_cap or 1.0), HAS_CAP=spec.logits_soft_cap is not None,
      HAS_SEG=spec.has_segment_ids, HAS_LEFT=band.left is not None,
      LEFT=int(band.left or 0), HAS_RIGHT=band.right is not None,
      RIGHT=int(band.right or 0), OFFSET=int(band.offset),
      PRECISION=(config.fp32_precision if spec.dtype == "float32" else None))


def _prepare(ops, spec, geo: Geometry):
  pad = lambda x, s, d: pad_axis(pad_axis(x, 1, s), 3, d)
  q = pad(ops.q, geo.seq_q_padded, geo.head_dim_padded)
  k = pad(ops.k, geo.seq_k_padded, geo.head_dim_padded)
  v = pad(ops.v, geo.seq_k_padded, geo.head_dim_v_padded)
  if ops.q_segment_ids is not None:
    q_ids = pad_axis(ops.q_segment_ids, 1, geo.seq_q_padded)
    kv_ids = pad_axis(ops.kv_segment_ids, 1, geo.seq_k_padded)
  else:  # never read (HAS_SEG is off); a pointer is still passed
    q_ids = kv_ids = jnp.zeros((1,), jnp.int32)
  return q, k, v, q_ids, kv_ids


def forward(ops, spec, static: _Static):
  cfg = static.config
  geo = Geometry.of(spec, cfg)
  q, k, v, q_ids, kv_ids = _prepare(ops, spec, geo)
  bm, bn = cfg.fwd.block_q, cfg.fwd.block_kv
  table = jnp.asarray(geo.kv_table(bm, bn))
  out, lse = jt.triton_call(
      q, k, v, q_ids, kv_ids, table, kernel=kernels.fwd_kernel,
      out_shape=[jax.ShapeDtypeStruct((spec.batch, geo.seq_q_padded, spec.heads_q,
                                       geo.head_dim_v_padded), q.dtype),
                 jax.ShapeDtypeStruct((spec.batch, spec.heads_q, geo.seq_q_padded),
                                      jnp.float32)],
      grid=(geo.seq_q_padded // bm, spec.batch * spec.heads_q),
      num_warps=cfg.fwd.num_warps, num_stages=cfg.fwd.num_stages,
      compute_capability=_compute_capability(), name="flashjax_triton_fwd",
      **_constexprs(spec, geo, bm, bn, cfg))
  return epilogue.finish_forward(out, lse, spec, ops.sinks)


def backward(ops, spec, static: _Static, out, lse, do, dlse):
  cfg = static.config
  geo = Geometry.of(spec, cfg)
  q, k, v, q_ids, kv_ids = _prepare(ops, spec, geo)
  sqp = geo.seq_q_padded
  row_delta, lse_rows, delta_rows = epilogue.backward_rows(out, do, dlse, lse, sqp)
  do_p = pad_axis(pad_axis(do.astype(q.dtype), 1, sqp), 3, geo.head_dim_v_padded)
  common = (q, k, v, do_p, lse_rows, delta_rows, q_ids, kv_ids)
  cc = _compute_capability()

  bm, bn = cfg.dq.block_q, cfg.dq.block_kv
  dq = jt.triton_call(
      *common, jnp.asarray(geo.kv_table(bm, bn)), kernel=kernels.dq_kernel,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(sqp // bm, spec.batch * spec.heads_q), num_warps=cfg.dq.num_warps,
      num_stages=cfg.dq.num_stages, compute_capability=cc, name="flashjax_triton_dq",
      **_constexprs(spec, geo, bm, bn, cfg))

  bm, bn = cfg.dkv.block_q, cfg.dkv.block_kv
  dk, dv = jt.triton_call(
      *common, jnp.asarray(geo.q_table(bm, bn)), kernel=kernels.dkv_kernel,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      grid=(geo.seq_k_padded // bn, spec.batch * spec.heads_kv),
      num_warps=cfg.dkv.num_warps, num_stages=cfg.dkv.num_stages,
      compute_capability=cc, name="flashjax_triton_dkv",
      **_constexprs(spec, geo, bm, bn, cfg))
  dsinks = epilogue.sinks_grad(ops.sinks, lse, row_delta) if spec.num_sinks else None
  return spec_lib.Operands(
      q=dq[:, :spec.seq_q, :, :spec.head_dim],
      k=dk[:, :spec.seq_k, :, :spec.head_dim],
      v=dv[:, :spec.seq_k, :, :spec.head_dim_v], sinks=dsinks)


def attention_from_operands(ops, spec, config: TritonKernelsConfig | None = None):
  if jax.default_backend() != "gpu":
    raise NotImplementedError("triton: needs a GPU (Triton kernels through jax-triton)")
  config = config or default_config(spec)
  if not isinstance(config, TritonKernelsConfig):
    raise ValueError(f"config must be a triton_gpu.TritonKernelsConfig, got "
                     f"{type(config).__name__}")
  return vjp.attention(forward, backward, ops, spec, _Static(config), per_shard=True)
