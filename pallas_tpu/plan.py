"""Static geometry of one call, kernel-layout operands and block tables."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from ..common import dropout as dropout_lib
from ..common import segments
from ..common.blocking import BlockGrid, pad_axis, pad_broadcastable
from ..common.spec import AttentionSpec, Operands
from .config import BlockSizes


@dataclasses.dataclass(frozen=True)
class Plan(BlockGrid):
  spec: AttentionSpec = None


def make_plan(spec: AttentionSpec, blocks: BlockSizes) -> Plan:
  return Plan(band=spec.band, block_q=blocks.block_q, block_kv=blocks.block_kv,
              spec=spec)


class KernelOperands(NamedTuple):
  """Head-major, padded; the wrapper transposes once so that every block is a
  contiguous (rows, head_dim) tile."""

  q: Any  # [B, Hq, Sqp, D]
  k: Any  # [B, Hkv, Skp, D]
  v: Any  # [B, Hkv, Skp, Dv]
  bias: Any  # [Bb, Hb, Sqb, Skb] fp32, each dim 1 or padded full
  mask: Any  # same, int8 (bool refs do not lower on TPU)
  q_ids: Any  # [B, Sqp, 1] int32: rows on sublanes
  kv_ids: Any  # [B, 1, Skp] int32: keys on lanes
  seed: Any  # [8] int32 (dropout_lib.kernel_seed; scalar prefetch, SMEM)


def prepare(ops: Operands, plan: Plan) -> KernelOperands:
  head_major = lambda x, s: pad_axis(jnp.swapaxes(x, 1, 2), 2, s)
  pad_seq = lambda x: pad_broadcastable(x, plan.seq_q_padded, plan.seq_k_padded)
  q_ids = kv_ids = None
  if ops.q_segment_ids is not None:
    q_ids = pad_axis(ops.q_segment_ids, 1, plan.seq_q_padded)[:, :, None]
    kv_ids = pad_axis(ops.kv_segment_ids, 1, plan.seq_k_padded)[:, None, :]
  seed = None
  if ops.dropout_seed is not None:
    seed = dropout_lib.kernel_seed(ops.dropout_seed, positions=True)
  return KernelOperands(
      q=head_major(ops.q, plan.seq_q_padded),
      k=head_major(ops.k, plan.seq_k_padded),
      v=head_major(ops.v, plan.seq_k_padded),
      bias=None if ops.bias is None else pad_seq(ops.bias.astype(jnp.float32)),
      mask=None if ops.mask is None else pad_seq(ops.mask.astype(jnp.int8)),
      q_ids=q_ids, kv_ids=kv_ids, seed=seed)


def segment_ranges(x: KernelOperands, plan: Plan):
  """Per-block min/max of segment ids (common/segments.py), flattened ``[B * n]``
  int32 (SMEM), or None. Disjoint ranges mean no id can match, for sorted or
  unsorted ids."""
  if x.q_ids is None:
    return None
  spec = plan.spec
  q, k = segments.id_ranges(x.q_ids[:, :spec.seq_q, 0], x.kv_ids[:, 0, :spec.seq_k],
                            plan.block_q, plan.block_kv, plan.num_q_blocks,
                            plan.num_kv_blocks)
  return tuple(a.reshape(-1) for a in (*q, *k))


def broadcast_index(shape, b, h, i, j):
  """Block index of a broadcastable [Bb, Hb, Sqb, Skb] operand at (b, h, i, j)."""
  return tuple(idx if n > 1 else 0 for idx, n in zip((b, h, i, j), shape))


def broadcast_block(shape, plan: Plan):
  return (None, None, plan.block_q if shape[2] > 1 else 1,
          plan.block_kv if shape[3] > 1 else 1)
