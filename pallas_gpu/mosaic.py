"""Entry point of the Pallas Mosaic-GPU platform (Hopper).

Forward: the warp-specialised kernel of mosaic_fwd.py. Backward: the Mosaic-GPU
dQ and dK/dV kernels of mosaic_bwd.py for head dims up to 128 (at 256 the dK and
dV register accumulators do not fit), Pallas-Triton's backward above that; both
take this forward's output and lse. Features the forward kernel lacks (bias, dense
mask, segment ids, dropout, fp32) raise NotImplementedError, so the frontend
routes those calls to Pallas-Triton.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ..common import autotune as tuning
from ..common import epilogue, hardware, vjp
from ..common import spec as spec_lib
from . import pallas_triton, triton_decode
from .mosaic_blocks import Geometry

DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
UNSUPPORTED = ("bias", "mask", "segment_ids", "dropout")


BACKWARD_KERNELS = ("mosaic", "triton")
MOSAIC_BWD_MAX_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """Forward and backward tiles; ``backward`` configures the Pallas-Triton
  backward where that one runs.

  Attributes:
    block_q: forward and dQ query rows per compute warpgroup (a CTA owns two).
    block_kv: forward keys per pipeline step.
    stages: forward K/V shared-memory slots in flight.
    persistent: forward with one CTA per SM walking the q tiles (True), one CTA
      per q tile (False), or None: persistent unless the band is causal or a
      window (uneven tiles balance better on the hardware scheduler).
    backward_kernel: "mosaic" (the Mosaic-GPU dQ and dK/dV kernels, head dims
      <= 128) or "triton" (Pallas-Triton's backward).
    dq_block_kv: dQ keys per pipeline step.
    dq_stages: dQ K/V shared-memory slots in flight.
    dkv_block_q: dK/dV query rows per pipeline step.
    dkv_block_kv: dK/dV keys per compute warpgroup (a CTA owns two).
    dkv_stages: dK/dV Q/dO shared-memory slots in flight.
    bwd_one_launch: run the dQ and dK/dV kernels as one launch (one grid tail
      instead of two) rather than one after the other.
    split_tail: the persistent forward runs its last, partial round of q tiles
      as key ranges merged by a small second kernel (triton_tail.py); applies to
      the full band only, where the plan finds a split that pays. The default
      config turns it on for D <= 64 with more than 2048 keys only. On an H200
      (2026-11-23, device time per call) it made the D = 64 B2 S8k H32 forward
      4.8% faster; at D = 128 it was 1.1% faster at B2 S8k but 1.4% slower at
      B8 S2k and mixed at B1 S16k, so it stays off there.
  """

  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  persistent: bool | None = None
  backward_kernel: str = "mosaic"
  dq_block_kv: int = 64
  dq_stages: int = 2
  dkv_block_q: int = 64
  dkv_block_kv: int = 64
  dkv_stages: int = 2
  bwd_one_launch: bool = True
  split_tail: bool = False
  backward: pallas_triton.TritonConfig | None = None

  def __post_init__(self):
    if self.block_q != 64:
      raise ValueError(f"block_q must be 64 (one wgmma M tile), got {self.block_q}")
    if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"block_kv must be 64, 128, 192 or 256, got {self.block_kv}")
    for name in ("stages", "dq_stages", "dkv_stages"):
      if getattr(self, name) < 2:
        raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
    if self.backward_kernel not in BACKWARD_KERNELS:
      raise ValueError(f"backward_kernel must be one of {BACKWARD_KERNELS}, got "
                       f"{self.backward_kernel!r}")
    for name in ("bwd_one_launch", "split_tail"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.dq_block_kv not in (64, 128):
      raise ValueError(f"dq_block_kv must be 64 or 128, got {self.dq_block_kv}")
    if self.dkv_block_kv != 64:
      raise ValueError(f"dkv_block_kv must be 64 (one wgmma M tile), got "
                       f"{self.dkv_block_kv}")
    # dK += dS^T Q contracts over the q rows: Mosaic-GPU wants 64-multiples.
    if self.dkv_block_q not in (64, 128):
      raise ValueError(f"dkv_block_q must be 64 or 128, got {self.dkv_block_q}")


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
  64-key blocks so two stages fit in 227 KiB. The split tail only where it was
  measured to pay (D = 64, long keys; see MosaicConfig)."""
  d = padded_head_dim(spec) or 256
  if d <= 64:
    return MosaicConfig(block_kv=128, stages=3, split_tail=spec.seq_k > 2048)
  if d <= 128:
    return MosaicConfig(block_kv=128, stages=2)
  return MosaicConfig(block_kv=64, stages=2)


def geometry(spec, config: MosaicConfig) -> Geometry:
  d = padded_head_dim(spec)
  tile = 2 * config.block_q
  persistent = config.persistent
  if persistent is None:
    persistent = spec.band.is_full
  return Geometry(
      batch=spec.batch, seq_q=spec.seq_q, seq_k=spec.seq_k,
      seq_q_padded=-(-spec.seq_q // tile) * tile,
      seq_k_padded=-(-spec.seq_k // config.block_kv) * config.block_kv,
      heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=d, band=spec.band,
      softmax_scale=spec.softmax_scale, soft_cap=spec.logits_soft_cap,
      block_q=config.block_q, block_kv=config.block_kv, stages=config.stages,
      dtype=spec.dtype, persistent_ctas=hardware.num_sms() if persistent else 0,
      split_tail=config.split_tail)


def backward_geometries(spec, config: MosaicConfig) -> tuple[Geometry, Geometry]:
  """dQ and dK/dV geometries over one padding of Sq and Sk, so both kernels read
  the same padded operands."""
  d = padded_head_dim(spec)
  lcm = lambda a, b: a * b // math.gcd(a, b)
  q_tile = lcm(2 * config.block_q, config.dkv_block_q)
  k_tile = lcm(config.dq_block_kv, 2 * config.dkv_block_kv)
  common = dict(
      batch=spec.batch, seq_q=spec.seq_q, seq_k=spec.seq_k,
      seq_q_padded=-(-spec.seq_q // q_tile) * q_tile,
      seq_k_padded=-(-spec.seq_k // k_tile) * k_tile,
      heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=d, band=spec.band,
      softmax_scale=spec.softmax_scale, soft_cap=spec.logits_soft_cap, dtype=spec.dtype)
  return (Geometry(block_q=config.block_q, block_kv=config.dq_block_kv,
                   stages=config.dq_stages, **common),
          Geometry(block_q=config.dkv_block_q, block_kv=config.dkv_block_kv,
                   stages=config.dkv_stages, **common))


def uses_mosaic_backward(spec, config: MosaicConfig) -> bool:
  return (config.backward_kernel == "mosaic" and
          padded_head_dim(spec) <= MOSAIC_BWD_MAX_HEAD_DIM)


@dataclasses.dataclass(frozen=True)
class _Static:
  config: MosaicConfig
  triton: pallas_triton._Static


def _pad(x, seq, d):
  return jnp.pad(x, ((0, 0), (0, seq - x.shape[1]), (0, 0), (0, d - x.shape[3])))


def forward(ops, spec, static: _Static):
  # Decode shapes have one q tile per head: the split-KV kernel spreads the keys
  # over the SMs instead (triton_decode.py).
  if triton_decode.applies(spec):
    return triton_decode.forward(ops, spec, None,
                                 hardware.num_sms(), False)
  from . import mosaic_fwd  # imports Mosaic-GPU lowering only when used
  g = geometry(spec, static.config)
  out, lse = mosaic_fwd.forward(_pad(ops.q, g.seq_q_padded, g.head_dim),
                                _pad(ops.k, g.seq_k_padded, g.head_dim),
                                _pad(ops.v, g.seq_k_padded, g.head_dim), g)
  return epilogue.finish_forward(out, lse, spec, ops.sinks)


def backward(ops, spec, static: _Static, out, lse, do, dlse):
  if not uses_mosaic_backward(spec, static.config):
    return pallas_triton.backward(ops, spec, static.triton, out, lse, do, dlse)
  from . import mosaic_bwd  # imports Mosaic-GPU lowering only when used
  g_dq, g_dkv = backward_geometries(spec, static.config)
  sqp, skp, d = g_dq.seq_q_padded, g_dq.seq_k_padded, g_dq.head_dim
  row_delta, lse_rows, delta_rows = epilogue.backward_rows(out, do, dlse, lse, sqp)
  stats = jnp.stack([lse_rows * mosaic_bwd.LOG2E, delta_rows], axis=2)
  stats = stats.astype(jnp.float32)
  q, do = _pad(ops.q, sqp, d), _pad(do.astype(ops.q.dtype), sqp, d)
  k, v = _pad(ops.k, skp, d), _pad(ops.v, skp, d)
  if static.config.bwd_one_launch:
    dq, dk, dv = mosaic_bwd.dq_dkv(q, k, v, do, stats, g_dq, g_dkv)
  else:
    dq = mosaic_bwd.dq(q, k, v, do, stats, g_dq)
    dk, dv = mosaic_bwd.dkv(q, k, v, do, stats, g_dkv)
  if g_dkv.group > 1:  # per query head -> per kv head, summed in fp32
    group = lambda x: x.astype(jnp.float32).reshape(
        x.shape[:2] + (spec.heads_kv, g_dkv.group, x.shape[-1])).sum(3)
    dk, dv = group(dk), group(dv)
  dsinks = None
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, row_delta)
  return spec_lib.Operands(
      q=dq[:, :spec.seq_q, :, :spec.head_dim],
      k=dk[:, :spec.seq_k, :, :spec.head_dim].astype(ops.k.dtype),
      v=dv[:, :spec.seq_k, :, :spec.head_dim_v].astype(ops.v.dtype), sinks=dsinks)


def resolve_config(spec, config: MosaicConfig | None) -> MosaicConfig:
  """Explicit, else cached, else tuned (FLASHJAX_AUTOTUNE=1 on a GPU), else the
  heuristic (mosaic_autotune.py, common/autotune.py)."""
  from . import mosaic_autotune
  return tuning.resolve(spec, config, cache=mosaic_autotune.CACHE,
                        tune=mosaic_autotune.tune, attention=flash_attention,
                        default=default_config(spec),
                        may_tune=jax.default_backend() == "gpu")


def attention_from_operands(ops, spec, config: MosaicConfig | None = None):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  if jax.default_backend() != "gpu":
    raise NotImplementedError("pallas-mosaic-gpu: needs a Hopper GPU")
  config = resolve_config(spec, config)
  if not isinstance(config, MosaicConfig):
    raise ValueError(f"config must be a pallas_gpu.MosaicConfig, got "
                     f"{type(config).__name__}")
  triton = pallas_triton._Static(
      config.backward or pallas_triton.resolve_config(spec, None, False), False)
  return vjp.attention(forward, backward, ops, spec, _Static(config, triton),
                       per_shard=True)


def flash_attention(q, k, v, *, config: MosaicConfig | None = None, **kwargs):
  """Mosaic-GPU flash attention (Hopper); the contract of docs/DESIGN.md minus bias,
  mask, segment ids and dropout."""
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  out, lse = attention_from_operands(ops, spec, config)
  return (out, lse) if spec.return_lse else out
