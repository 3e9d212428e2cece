"""Block geometry shared by blockwise platforms: padding, block counts, and the
block ranges the band lets each q block (or kv block) reach."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .mask import Band


def pad_axis(x, axis: int, size: int, value=0):
  """Pads ``axis`` of ``x`` at the end up to ``size`` (no-op if already there)."""
  extra = size - x.shape[axis]
  if extra <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def pad_broadcastable(x, seq_q_padded: int, seq_k_padded: int, value=0):
  """Pads the sequence dims of a rank-4 [Bb, Hb, Sqb, Skb] bias/mask where they
  are not broadcast (size 1)."""
  if x.shape[2] > 1:
    x = pad_axis(x, 2, seq_q_padded, value)
  if x.shape[3] > 1:
    x = pad_axis(x, 3, seq_k_padded, value)
  return x


@dataclasses.dataclass(frozen=True)
class BlockGrid:
  """Square tiling of a (Sq, Sk) problem into ``block_q x block_kv`` blocks."""

  band: Band
  block_q: int
  block_kv: int

  @property
  def num_q_blocks(self) -> int:
    return -(-self.band.seq_q // self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return -(-self.band.seq_k // self.block_kv)

  @property
  def seq_q_padded(self) -> int:
    return self.num_q_blocks * self.block_q

  @property
  def seq_k_padded(self) -> int:
    return self.num_kv_blocks * self.block_kv

  def kv_block_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    """Per q block, the half-open kv block range ``[lo, hi)`` the band reaches
    (``lo = hi = 0`` when it reaches none)."""
    lo, hi = [], []
    for i in range(self.num_q_blocks):
      a, b = self.band.kv_bounds(i * self.block_q,
                                 min((i + 1) * self.block_q, self.band.seq_q))
      lo.append(a // self.block_kv if b > a else 0)
      hi.append(-(-b // self.block_kv) if b > a else 0)
    return np.asarray(lo, np.int32), np.asarray(hi, np.int32)

  def q_block_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    """Per kv block, the q blocks ``[lo, hi)`` that reach it."""
    lo, hi = [], []
    for j in range(self.num_kv_blocks):
      a, b = self.band.q_bounds(j * self.block_kv,
                                min((j + 1) * self.block_kv, self.band.seq_k))
      lo.append(a // self.block_q if b > a else 0)
      hi.append(-(-b // self.block_q) if b > a else 0)
    return np.asarray(lo, np.int32), np.asarray(hi, np.int32)
