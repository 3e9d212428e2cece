"""Configs, padding and block-range tables of the triton_gpu kernels."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ..common import dropout as dropout_lib
from ..common import blocking, env, hardware, platform, segments
from ..common.hardware import GpuTarget
from ..common.launch import (KernelConfig, KernelsConfig, fit_to_lengths,
                             fit_to_shared_memory, streamed_budget)
from ..common.spec import AttentionSpec


def default_config(spec: AttentionSpec,
                   target: GpuTarget | None = None) -> KernelsConfig:
  """Tiles by head dim, overridden by jax-flash-attn2's BLOCKSIZE_M_FLASH_ATTN /
  BLOCKSIZE_N_FLASH_ATTN (forward tiles); the streamed tiles fit ``target``'s
  shared memory (default: the default device's generation)."""
  d = max(spec.head_dim, spec.head_dim_v)
  if d <= 64:
    cfg = KernelsConfig(fwd=KernelConfig(block_q=128, block_kv=64, num_warps=4,
                                         num_stages=3))
  elif d <= 128:
    cfg = KernelsConfig(fwd=KernelConfig(block_q=128, block_kv=64, num_warps=8,
                                         num_stages=3))
  else:
    cfg = KernelsConfig(
        fwd=KernelConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
        dq=KernelConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1),
        dkv=KernelConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1))
  cfg = platform.with_block_sizes(cfg, env.positive_int("BLOCKSIZE_M_FLASH_ATTN"),
                                  env.positive_int("BLOCKSIZE_N_FLASH_ATTN"), ("fwd",))
  budget = streamed_budget(target or hardware.gpu_target())
  return fit_to_shared_memory(fit_to_lengths(cfg, spec), spec, budget=budget)


@dataclasses.dataclass(frozen=True)
class Geometry(blocking.PaddedLengths):
  """Padded sizes shared by the three kernels (``blocking.PaddedLengths``:
  sequences padded to the largest tile, head dims to powers of two)."""

  spec: AttentionSpec
  pad_q: int
  pad_k: int

  @classmethod
  def of(cls, spec, config: KernelsConfig):
    return cls(spec, *blocking.shared_padding((config.fwd, config.dq, config.dkv)))

  def kv_table(self, bq: int, bk: int) -> np.ndarray:
    """``[nq, 4]`` int32: per q block, kv blocks ``lo <= a <= b <= hi``: [lo, hi)
    reachable, [a, b) needing no positional mask (common/blocking.py)."""
    return blocking.kv_block_table(self.spec.band, bq, bk, self.seq_q_padded // bq)

  def q_table(self, bq: int, bk: int) -> np.ndarray:
    """``[nk, 4]``: the transpose, per kv block over q blocks; a kv block holding
    padded keys masks every q block."""
    return blocking.q_block_table(self.spec.band, bk, bq, self.seq_k_padded // bk,
                                  strict_kv=True)

  def block_table(self, bq: int, bk: int, over_kv: bool, segment_ids=None):
    """``[B, n, 4]`` int32 loop boundaries of each program: :meth:`kv_table`
    (``over_kv``) or :meth:`q_table` per batch element, narrowed by
    ``segment_ids = (q_ids [B, Sq], kv_ids [B, Sk])`` (traced) to the blocks the
    ids leave visible (common/segments.py)."""
    static = self.kv_table(bq, bk) if over_kv else self.q_table(bq, bk)
    table = np.broadcast_to(static, (self.spec.batch,) + static.shape)
    if segment_ids is None:
      return table
    q, kv = segments.id_ranges(*segment_ids, bq, bk, self.seq_q_padded // bq,
                               self.seq_k_padded // bk)
    lo, hi = segments.visible_blocks(q, kv, self.spec.band, bq, bk, over_kv=over_kv)
    bounds = segments.narrow(tuple(table[..., c] for c in range(4)), lo, hi)
    return jnp.stack(bounds, -1).astype(jnp.int32)


def _strides(shape, names):
  """Element strides of a contiguous rank-4 array, 0 on its size-1 dims."""
  if shape is None:
    return dict.fromkeys(names, 0)
  strides = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1]
  return {n: (s if d > 1 else 0) for n, s, d in zip(names, strides, shape)}


def constexprs(spec: AttentionSpec, geo: Geometry, bm: int, bn: int,
               config: KernelsConfig, bias_shape=None, mask_shape=None) -> dict:
  """The kernels' constexpr arguments (listed in kernels.py) for one launch;
  ``bias_shape``/``mask_shape`` are the padded operands' shapes, or None."""
  band = spec.band
  drop = spec.dropout_rate > 0
  return dict(
      SQ=geo.seq_q_padded, SK=geo.seq_k_padded, HQ=spec.heads_q, HKV=spec.heads_kv,
      D=geo.head_dim_padded, DV=geo.head_dim_v_padded, BM=bm, BN=bn,
      SEQ_K=spec.seq_k, SCALE=float(spec.softmax_scale),
      CAP=float(spec.logits_soft_cap or 1.0), HAS_CAP=spec.logits_soft_cap is not None,
      HAS_SEG=spec.has_segment_ids, HAS_LEFT=band.left is not None,
      LEFT=int(band.left or 0), HAS_RIGHT=band.right is not None,
      RIGHT=int(band.right or 0), OFFSET=int(band.offset),
      HAS_BIAS=bias_shape is not None, **_strides(bias_shape, ("BSB", "BSH", "BSQ", "BSK")),
      HAS_MASK=mask_shape is not None, **_strides(mask_shape, ("MSB", "MSH", "MSQ", "MSK")),
      HAS_DROP=drop,
      THRESH=dropout_lib.threshold(spec.dropout_rate) if drop else 0,
      DROP_SCALE=dropout_lib.keep_scale(spec.dropout_rate),
      PRECISION=(config.fp32_precision if spec.dtype == "float32" else None))
