"""Geometry, configs and in-kernel tile math of the Pallas-Triton kernels."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...common import dropout as dropout_lib
from ...common import segments
from ...common import blocking
from ...common.blocking import LOG2E, pad_axis, pad_broadcastable
from ...common.launch import KernelConfig, KernelsConfig  # noqa: F401
from ...common.mask import tile_allowed
from ...common.spec import AttentionSpec, Operands



@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonForward(KernelConfig):
  """The forward kernel's tiles (common/launch.py) and launch order.

  ``fold_causal``: with a causal band (keys up to the diagonal, any offset, no left
  window edge) each forward program runs q block ``n - 1 - p`` and then block
  ``p``, so every program does the same work (n + 1 kv tiles) and the grid has no
  tail of long programs. 1.20-1.23x vs 1.12-1.16x JAX's example at B1 S16k
  causal on an H200 with 128x128 8-warp tiles (2026-11-22, docs/BENCHMARKS.md);
  off by default for explicit configs, on where default_config measured it.

  ``split_tail``: a non-causal forward (full band, no dropout) whose programs fill
  two or more waves runs each program of the last, partial wave as a few key-range
  parts, combined after the launch (pallas_gpu/split_tail.py). ``tail_slots``: programs
  that run at once (0: one per SM of the default device, which is what the long-key
  D <= 128 tiles of default_config occupy).
  """

  fold_causal: bool = False
  split_tail: bool = False
  tail_slots: int = 0

  def __post_init__(self):
    super().__post_init__()
    for name in ("fold_causal", "split_tail"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if not isinstance(self.tail_slots, int) or isinstance(self.tail_slots, bool) or (
        self.tail_slots < 0):
      raise ValueError(f"tail_slots must be an int >= 0, got {self.tail_slots!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonConfig(KernelsConfig):
  """The forward (:class:`TritonForward`), dq and dkv kernels of
  common/launch.py."""

  fwd: TritonForward = TritonForward(block_q=128, block_kv=64, num_warps=4,
                                     num_stages=3)


@dataclasses.dataclass(frozen=True)
class Plan(blocking.PaddedLengths):
  """One kernel's tiles over sequences padded to multiples of ``pad_q``/``pad_k``
  (the largest tile of forward and backward, so all kernels share one padding);
  ``blocking.PaddedLengths`` gives the padded sizes."""

  spec: AttentionSpec
  block_q: int
  block_kv: int
  pad_q: int
  pad_k: int
  fp32_precision: str = "ieee"
  # exp2 as the bare ex2.approx.ftz instruction (compiled kernels; the
  # interpreter has no inline PTX).
  fast_exp2: bool = False

  @property
  def num_q_blocks(self):
    return self.seq_q_padded // self.block_q

  @property
  def num_kv_blocks(self):
    return self.seq_k_padded // self.block_kv

  @property
  def precision(self):
    if self.spec.dtype == "float32" and self.fp32_precision == "ieee":
      return jax.lax.Precision.HIGHEST
    return None

  # -- block ranges from the band (traced scalars inside kernels) -------------------

  def kv_ranges(self, i):
    """kv blocks ``lo <= lo_full <= hi_full <= hi`` of q block i: [lo, hi) are
    reachable, [lo_full, hi_full) need no positional mask (common/blocking.py)."""
    return blocking.kv_block_range(self.spec.band, i * self.block_q, self.block_q,
                                   self.block_kv)

  def q_ranges(self, j):
    """The transpose: q blocks reaching kv block j, and those needing no mask; a kv
    block holding padded keys masks every q block."""
    return blocking.q_block_range(self.spec.band, j * self.block_kv, self.block_kv,
                                  self.block_q, strict_kv=True)


def make_plans(spec: AttentionSpec, config: TritonConfig,
               fast_exp2: bool = False) -> dict[str, Plan]:
  kernels = {"fwd": config.fwd, "dq": config.dq, "dkv": config.dkv}
  pad_q, pad_k = blocking.shared_padding(kernels.values())
  return {name: Plan(spec, c.block_q, c.block_kv, pad_q, pad_k, config.fp32_precision,
                     fast_exp2)
          for name, c in kernels.items()}


class KernelOperands(NamedTuple):
  q: Any  # [B, Sqp, Hq, Dp]
  k: Any  # [B, Skp, Hkv, Dp]
  v: Any  # [B, Skp, Hkv, Dvp]
  bias: Any  # [Bb, Hb, Sqb, Skb] fp32 (1 or padded full per dim)
  mask: Any  # same, int8
  q_ids: Any  # [B, Sqp] int32
  kv_ids: Any  # [B, Skp] int32
  seed: Any  # [8] int32: dropout_lib.kernel_seed(..., positions=True)


def prepare(ops: Operands, plan: Plan) -> KernelOperands:
  """Pads sequences to block multiples and head dims to powers of two (zeros:
  they add nothing to q.k or to p.v)."""
  dp, dvp = plan.head_dim_padded, plan.head_dim_v_padded
  pad4 = lambda x, s, d: pad_axis(pad_axis(x, 1, s), 3, d)
  pad_seq = lambda x: pad_broadcastable(x, plan.seq_q_padded, plan.seq_k_padded)
  bias = mask = q_ids = kv_ids = seed = None
  if ops.bias is not None:
    bias = pad_seq(ops.bias.astype(jnp.float32))
  if ops.mask is not None:
    mask = pad_seq(ops.mask.astype(jnp.int8))
  if ops.q_segment_ids is not None:
    q_ids = pad_axis(ops.q_segment_ids, 1, plan.seq_q_padded)
    kv_ids = pad_axis(ops.kv_segment_ids, 1, plan.seq_k_padded)
  if ops.dropout_seed is not None:
    seed = dropout_lib.kernel_seed(ops.dropout_seed, positions=True)
  return KernelOperands(pad4(ops.q, plan.seq_q_padded, dp),
                        pad4(ops.k, plan.seq_k_padded, dp),
                        pad4(ops.v, plan.seq_k_padded, dvp),
                        bias, mask, q_ids, kv_ids, seed)


def visible_blocks(ops: Operands, plan: Plan, over_kv: bool = True):
  """Per q block (``over_kv``) or kv block, the block range ``(lo, hi)`` that
  segment ids and band leave visible (common/segments.py), ``[B, n]`` int32 with
  n padded to a power of two (Triton's block shapes), or None without ids."""
  if ops.q_segment_ids is None:
    return None
  q, kv = segments.id_ranges(ops.q_segment_ids, ops.kv_segment_ids, plan.block_q,
                             plan.block_kv, plan.num_q_blocks, plan.num_kv_blocks)
  lo, hi = segments.visible_blocks(q, kv, plan.spec.band, plan.block_q,
                                   plan.block_kv, over_kv=over_kv)
  n = 1 << (lo.shape[1] - 1).bit_length()
  return pad_axis(lo, 1, n), pad_axis(hi, 1, n)


def narrow_to_segments(r: dict, bounds, outer):
  """Loop boundaries of outer block ``outer`` clipped to its visible range when
  the kernel has one (refs ``seg_lo``/``seg_hi``): the loops then run over the
  blocks of the documents the block holds, not the band's whole range."""
  if "seg_lo" not in r:
    return bounds
  return segments.narrow(bounds, r["seg_lo"][outer], r["seg_hi"][outer])


# -- tile math -----------------------------------------------------------------------


def dot(a, b, plan: Plan, trans_b=False):
  if trans_b:
    b = b.T
  return jnp.dot(a, b, precision=plan.precision, preferred_element_type=jnp.float32)


def logits2(plan: Plan, q, k, bias):
  """Logits in base 2 (``s * log2(e)``, so exp2 can replace exp) and, with a soft
  cap, its tanh for the backward."""
  spec = plan.spec
  qk = dot(q, k, plan, trans_b=True)
  if bias is None and spec.logits_soft_cap is None:
    return qk * (spec.softmax_scale * LOG2E), None
  s = qk * spec.softmax_scale
  if bias is not None:
    s = s + bias
  t = None
  if spec.logits_soft_cap is not None:
    t = jnp.tanh(s / spec.logits_soft_cap)
    s = spec.logits_soft_cap * t
  return s * LOG2E, t


def exp2(x, plan: Plan):
  """``2 ** x``. jnp.exp2 lowers to libdevice's exp2f, which keeps fp32
  denormal results; the bare ``ex2.approx.ftz`` flushes them to 0 (no softmax
  weight that matters is that small) and made the D = 128 forward 5-6% faster on
  an H200 (2026-11-22, docs/BENCHMARKS.md)."""
  if not plan.fast_exp2 or x.dtype != jnp.float32:
    return jnp.exp2(x)
  return plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def allowed(plan: Plan, i, j, positional: bool, q_ids=None, kv_ids=None, mask=None):
  """``mask.tile_allowed`` of block (i, j) with its rows' and keys' ids (1-D)."""
  rows = cols = None
  if positional:
    rows, cols = blocking.positions(i, j, plan.block_q, plan.block_kv)
  if q_ids is not None:
    q_ids, kv_ids = q_ids[:, None], kv_ids[None, :]
  return tile_allowed(plan.spec.band, rows, cols,
                      padded_keys=plan.seq_k_padded != plan.spec.seq_k,
                      q_ids=q_ids, kv_ids=kv_ids, mask=mask)


def dropout_keep(plan: Plan, seed_ref, b, h, i, j, bq=None, bk=None):
  """Keep-mask ``[bq, bk]`` (``dropout.keep``); the row key is hashed once per
  row. ``b``/``h`` and the tile's rows and keys are the program's local indices;
  ``seed_ref`` adds the offsets of the shard (batch, head) and of the block of a
  larger call (row, key: a hop of ring attention)."""
  bq, bk = bq or plan.block_q, bk or plan.block_kv
  rows, cols = blocking.positions(i, j, bq, bk, dense=False)
  seed, b_off, h_off, i_off, j_off = (seed_ref[pl.ds(n, 1)] for n in range(5))
  return dropout_lib.keep(seed, b + b_off, h + h_off, rows + i_off, cols + j_off,
                          plan.spec.dropout_rate)
