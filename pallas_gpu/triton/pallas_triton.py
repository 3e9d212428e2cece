"""Pallas kernels lowered through Triton: the portable GPU path (Ampere, Ada,
Hopper, AMD) with the whole contract. ``interpret=True`` runs the same kernels in
Pallas' interpreter on any backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...common import spec as spec_lib
from ...common import epilogue, hardware, launch, platform, vjp
from . import autotune, bwd, decode, fwd
from . import plan as tp
from .plan import KernelConfig, TritonConfig, TritonForward

NAME = "pallas-triton"
CONFIG = TritonConfig
# The whole contract; D <= 256: q, the o accumulator and k/v tiles of 256 columns
# fill the shared memory.
CAPABILITIES = platform.Capabilities(dtypes=("float32", "bfloat16", "float16"),
                                     max_head_dim=256, interpret=True)


def supported(spec: spec_lib.AttentionSpec) -> str | None:
  return CAPABILITIES.unsupported(spec)


# Backward tiles for heads wider than 128: 64x64 over 8 warps (the dK/dV or dQ
# accumulators of a 256-wide head take half the registers per thread of 4 warps):
# 1.61-1.64x / 1.43-1.47x (causal) the 32x32 4-warp 1-stage tiles at B2 S8k H8 D256 (H200,
# 2026-11-22, docs/BENCHMARKS.md); 3 stages or 128-wide tiles do not
# fit shared memory. Also with a full fp32 bias at bf16 (1.44x at B1 S4k H8; GPU
# tests with a bias, mask or segment ids at 2 bytes passed there); where a bias or
# mask tile would overflow, fit_to_shared_memory halves the streamed side.
WIDE_BWD = KernelConfig(block_q=64, block_kv=64, num_warps=8, num_stages=2)


def default_config(spec: spec_lib.AttentionSpec,
                   target: hardware.GpuTarget | None = None) -> TritonConfig:
  """Tiles by head dim: larger heads leave room for fewer rows. Small problems get
  tiles no larger than their (power-of-two rounded) lengths. ``target`` (default:
  the default device's generation) sizes the streamed tiles to its shared
  memory; the long-key tiles and the split tail are Hopper's (measured there)."""
  target = target or hardware.gpu_target()
  d = max(spec.head_dim, spec.head_dim_v)
  if d <= 64:
    # Folded causal programs: 1.52x JAX's example vs 1.44-1.48x at B2 S8k (one run).
    cfg = TritonConfig(fwd=TritonForward(block_q=128, block_kv=64, num_warps=4,
                                         num_stages=3, fold_causal=spec.seq_k > 2048))
  elif d <= 128:
    # The H200 autotune winner for D = 128 at S >= 8k; keys up to 2k run better
    # in 4-warp 128x64 programs with 2 stages, two per SM (1.22x JAX's example
    # vs 1.17x at B8 S2k, 1.00x vs 1.15x at B1 S16k: docs/reports/*-pallas-triton-sweeps).
    # Long keys: causal programs paired (fold_causal), 1.20-1.23x vs 1.12-1.16x
    # at B1 S16k causal; with the short-key tiles folding gave 1.00x vs 1.17x.
    # Long keys at 2 bytes also split the forward's last wave (split_tail): these
    # tiles run one program per SM.
    # Other generations keep the short-key tiles: the long ones were measured on
    # Hopper only, and need its shared memory.
    short = spec.seq_k <= 2048 or not target.hopper
    split = not short and spec.dtype != "float32"
    cfg = TritonConfig(fwd=TritonForward(block_q=128, block_kv=64 if short else 128,
                                         num_warps=4 if short else 8,
                                         num_stages=2 if short else 3,
                                         fold_causal=not short, split_tail=split),
                       dq=KernelConfig(block_q=64, block_kv=64, num_warps=4,
                                       num_stages=2),
                       dkv=KernelConfig(block_q=64, block_kv=64, num_warps=4,
                                        num_stages=2))
  else:
    cfg = TritonConfig(fwd=TritonForward(block_q=64, block_kv=32, num_warps=4,
                                         num_stages=2), dq=WIDE_BWD, dkv=WIDE_BWD)
  return launch.fit_to_shared_memory(launch.fit_to_lengths(cfg, spec), spec,
                                     budget=launch.streamed_budget(target))


# jax-flash-attn2's ``blocksize_q``/``blocksize_k``: the forward's tiles.
config_from_block_sizes = platform.block_sizes(default_config, ("fwd",))


def forward(ops, spec, static: platform.Static):
  if decode.applies(spec):
    return decode.forward(ops, spec, None,
                          hardware.num_sms(), static.interpret)
  cfg = static.config
  plans = tp.make_plans(spec, cfg, fast_exp2=not static.interpret)
  plan = plans["fwd"]
  slots = (cfg.fwd.tail_slots or hardware.num_sms()) if cfg.fwd.split_tail else 0
  out, lse = fwd.forward(tp.prepare(ops, plan), plan, cfg.fwd, static.interpret,
                         cfg.fwd.fold_causal, slots, tp.visible_blocks(ops, plan))
  return epilogue.finish_forward(out, lse, spec, ops.sinks)


def backward(ops, spec, static: platform.Static, out, lse, do, dlse):
  plans = tp.make_plans(spec, static.config, fast_exp2=not static.interpret)
  x = tp.prepare(ops, plans["dq"])
  sqp = plans["dq"].seq_q_padded
  delta, lse_rows, delta_rows = epilogue.backward_rows(out, do, dlse, lse, sqp)
  do_k = jnp.pad(do.astype(ops.q.dtype), ((0, 0), (0, sqp - spec.seq_q), (0, 0),
                                          (0, plans["dq"].head_dim_v_padded -
                                           spec.head_dim_v)))
  dq, dk, dv, ds = bwd.backward(
      x, plans["dq"], plans["dkv"], static.config.dq, static.config.dkv, do_k,
      lse_rows, delta_rows, static.interpret,
      tp.visible_blocks(ops, plans["dq"]),
      tp.visible_blocks(ops, plans["dkv"], over_kv=False))
  dbias = dsinks = None
  if ops.bias is not None:
    dbias = epilogue.dbias_from_ds(ds, spec, ops.bias)
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, delta)
  return spec_lib.Operands(
      q=dq[:, :spec.seq_q, :, :spec.head_dim],
      k=dk[:, :spec.seq_k, :, :spec.head_dim],
      v=dv[:, :spec.seq_k, :, :spec.head_dim_v], bias=dbias, sinks=dsinks)


def resolve_config(spec, config: TritonConfig | None, interpret: bool) -> TritonConfig:
  """Explicit, else cached, else tuned (FLASHJAX_AUTOTUNE=1 on a GPU), else the
  heuristic (common/autotune.py)."""
  return autotune.TUNER.resolve(spec, config, attention=flash_attention,
                                default=default_config(spec), may_tune=not interpret)


def attention_from_operands(ops, spec, config: TritonConfig | None = None,
                            interpret: bool = False):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  if not interpret and jax.default_backend() != "gpu":
    raise NotImplementedError("needs a GPU, or interpret=True")
  config = platform.check_config(resolve_config(spec, config, interpret), TritonConfig,
                                 NAME)
  return vjp.attention(forward, backward, ops, spec,
                       platform.Static(config, bool(interpret)), per_shard=True)


# fp32 inputs use full-precision (IEEE) products unless
# ``config.fp32_precision == "tf32"``.
flash_attention = platform.entry(NAME, attention_from_operands, CAPABILITIES)
