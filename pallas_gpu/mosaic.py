"""Entry point of the Pallas Mosaic-GPU platform (Hopper).

Forward: the warp-specialised kernel of mosaic_fwd.py. Backward: the Pallas-Triton
dq/dkv kernels, fed this forward's output and lse (a Mosaic-GPU backward is not
written yet). Features the forward kernel lacks (bias, dense mask, segment ids,
dropout, fp32) raise NotImplementedError, so the frontend routes those calls to
Pallas-Triton.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..common import epilogue, vjp
from ..common import spec as spec_lib
from . import pallas_triton
from .mosaic_fwd import Geometry

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
UNSUPPORTED = ("bias", "mask", "segment_ids", "dropout")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """Forward tiles; ``backward`` configures the Pallas-Triton backward.

  Attributes:
    block_q: query rows per compute warpgroup (a CTA owns two such blocks).
    block_kv: keys per pipeline step.
    stages: K/V shared-memory slots in flight.
  """

  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  backward: pallas_triton.TritonConfig | None = None

  def __post_init__(self):
    if self.block_q != 64:
      raise ValueError(f"block_q must be 64 (one wgmma M tile), got {self.block_q}")
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
    if self.stages < 2:
      raise ValueError(f"stages must be >= 2, got {self.stages}")


def padded_head_dim(spec) -> int | None:
  d = max(spec.head_dim, spec.head_dim_v)
  return next((x for x in HEAD_DIMS if x >= d), None)


def supported(spec: spec_lib.AttentionSpec) -> str | None:
  if spec.dtype not in DTYPES:
    return f"pallas-mosaic-gpu: dtype {spec.dtype} (supported: {', '.join(DTYPES)})"
  if padded_head_dim(spec) is None:
    return f"pallas-mosaic-gpu: head dim {max(spec.head_dim, spec.head_dim_v)} > 256"
  used = sorted(spec.features & set(UNSUPPORTED))
  if used:
    return f"pallas-mosaic-gpu: features {', '.join(used)} not in this kernel"
  return None


def default_config(spec: spec_lib.AttentionSpec) -> MosaicConfig:
  """Shared memory holds 2 q blocks and ``stages`` K and V blocks: D = 256 keeps
  64-key blocks so two stages fit in 227 KiB."""
  d = padded_head_dim(spec) or 256
  if d <= 64:
    return MosaicConfig(block_kv=128, stages=3)
  if d <= 128:
    return MosaicConfig(block_kv=128, stages=2)
  return MosaicConfig(block_kv=64, stages=2)


def geometry(spec, config: MosaicConfig) -> Geometry:
  d = padded_head_dim(spec)
  tile = 2 * config.block_q
  return Geometry(
      batch=spec.batch, seq_q=spec.seq_q, seq_k=spec.seq_k,
      seq_q_padded=-(-spec.seq_q // tile) * tile,
      seq_k_padded=-(-spec.seq_k // config.block_kv) * config.block_kv,
      heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=d, band=spec.band,
      softmax_scale=spec.softmax_scale, soft_cap=spec.logits_soft_cap,
      block_q=config.block_q, block_kv=config.block_kv, stages=config.stages,
      dtype=spec.dtype)


@dataclasses.dataclass(frozen=True)
class _Static:
  config: MosaicConfig
  triton: pallas_triton._Static


def _pad(x, seq, d):
  return jnp.pad(x, ((0, 0), (0, seq - x.shape[1]), (0, 0), (0, d - x.shape[3])))


def forward(ops, spec, static: _Static):
  from . import mosaic_fwd  # imports Mosaic-GPU lowering only when used
  g = geometry(spec, static.config)
  out, lse = mosaic_fwd.forward(_pad(ops.q, g.seq_q_padded, g.head_dim),
                                _pad(ops.k, g.seq_k_padded, g.head_dim),
                                _pad(ops.v, g.seq_k_padded, g.head_dim), g)
  return epilogue.finish_forward(out, lse, spec, ops.sinks)


def backward(ops, spec, static: _Static, out, lse, do, dlse):
  return pallas_triton.backward(ops, spec, static.triton, out, lse, do, dlse)


def attention_from_operands(ops, spec, config: MosaicConfig | None = None):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  if jax.default_backend() != "gpu":
    raise NotImplementedError("pallas-mosaic-gpu: needs a Hopper GPU")
  config = config or default_config(spec)
  if not isinstance(config, MosaicConfig):
    raise ValueError(f"config must be a pallas_gpu.MosaicConfig, got "
                     f"{type(config).__name__}")
  triton = pallas_triton._Static(
      config.backward or pallas_triton.resolve_config(spec, None, False), False)
  return vjp.attention(forward, backward, ops, spec, _Static(config, triton),
                       per_shard=True)


def flash_attention(q, k, v, *, config: MosaicConfig | None = None, **kwargs):
  """Mosaic-GPU flash attention (Hopper); the contract of DESIGN.md minus bias,
  mask, segment ids and dropout."""
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  out, lse = attention_from_operands(ops, spec, config)
  return (out, lse) if spec.return_lse else out
