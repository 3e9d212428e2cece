"""Tile and launch configs of the GPU kernel platforms that run a forward, a dq and a
dkv kernel (Pallas-Triton and triton): one definition for both."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from . import configs, hardware


def tile_size(n: int) -> int:
  """``n`` rounded up to a power of two, at least 16: Triton's tile sides (and the
  padded head dims of the Triton-based kernels)."""
  return max(16, 1 << (n - 1).bit_length())


def _pow2(name, value, lo=16):
  if not isinstance(value, int) or value < lo or value & (value - 1):
    raise ValueError(f"{name} must be a power of two >= {lo}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  """One kernel's tiles and launch parameters (Triton needs power-of-two tile
  sides)."""

  block_q: int
  block_kv: int
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _pow2("block_q", self.block_q)
    _pow2("block_kv", self.block_kv)
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages must be a positive int, got {self.num_stages}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelsConfig:
  """Forward, dq and dkv kernels. ``fp32_precision`` "ieee" keeps fp32 inputs
  exact; "tf32" trades 10-bit mantissa products for speed."""

  fwd: KernelConfig = KernelConfig(block_q=128, block_kv=64, num_warps=4,
                                   num_stages=3)
  dq: KernelConfig = KernelConfig(block_q=64, block_kv=64, num_warps=4,
                                  num_stages=2)
  dkv: KernelConfig = KernelConfig(block_q=64, block_kv=64, num_warps=4,
                                   num_stages=2)
  fp32_precision: str = "ieee"

  def __post_init__(self):
    configs.check_parts(self)
    if self.fp32_precision not in ("ieee", "tf32"):
      raise ValueError(f"fp32_precision must be 'ieee' or 'tf32', got "
                       f"{self.fp32_precision!r}")

  @classmethod
  def from_json(cls, d: dict) -> "KernelsConfig":
    """The inverse of ``dataclasses.asdict``: each kernel's dict becomes its
    field's class (a subclass's forward class included); missing fields take
    their defaults, unknown ones raise ``TypeError`` (common/configs.py)."""
    return configs.from_dict(cls, d)


def kernel_configs(*rows) -> tuple[KernelConfig, ...]:
  """Kernel configs from ``(block_q, block_kv, num_warps, num_stages)`` rows (the
  autotuners' candidate tables)."""
  return tuple(KernelConfig(block_q=q, block_kv=kv, num_warps=w, num_stages=s)
               for q, kv, w, s in rows)


def kernel_pairs(*rows) -> tuple[tuple[KernelConfig, KernelConfig], ...]:
  """``(dq, dkv)`` pairs from rows of one ``(block_q, block_kv, num_warps,
  num_stages)`` tuple (both kernels) or two (dq's, dkv's)."""
  pair = lambda row: kernel_configs(*(row if isinstance(row[0], tuple) else (row, row)))
  return tuple(pair(row) for row in rows)


def fit_to_lengths(cfg: KernelsConfig, spec) -> KernelsConfig:
  """Tiles no larger than the (power-of-two rounded) sequence lengths."""
  clip = lambda c: dataclasses.replace(c, block_q=min(c.block_q, tile_size(spec.seq_q)),
                                       block_kv=min(c.block_kv, tile_size(spec.seq_k)))
  return dataclasses.replace(cfg, fwd=clip(cfg.fwd), dq=clip(cfg.dq), dkv=clip(cfg.dkv))


# Shared memory left to the resident tiles of 2-byte inputs (measured on Hopper):
# the pipelined input tiles get all but this much of a block's shared memory (the
# Q or dO tile and layout conversions take the rest: 200 of 227 KiB).
RESERVED = 27 * 1024


def streamed_budget(target: hardware.GpuTarget) -> int:
  """Shared memory of ``target`` that the pipelined input tiles may take."""
  return target.shared_memory - RESERVED


# Of the 227 KiB of shared memory a Hopper block may use, what the pipelined input
# tiles may take (the rest: Q or dO tiles, layout conversions).
SHARED_MEMORY_BUDGET = streamed_budget(hardware.HOPPER)


def fit_to_shared_memory(cfg: KernelsConfig, spec,
                         budget: int = SHARED_MEMORY_BUDGET) -> KernelsConfig:
  """Halves each kernel's streamed tile (K/V rows for fwd and dq, Q/dO rows for
  dkv) until ``num_stages`` copies of it fit ``budget``. The defaults are tuned
  for 2-byte inputs without bias; fp32 doubles their bytes (a 128-key fp32 tile at
  D = 128 with 3 stages asks for 384 KiB and fails to launch), and a bias or mask
  tile rides along each streamed row (bf16 D = 128 with a full fp32 bias asked an
  H200 for 353 KiB).

  fp32 dots stage both operands in shared memory, so at 4 bytes a resident tile
  and, in the forward, the ``block_q x block_kv`` probabilities count too,
  against the whole of ``budget + RESERVED``. Triton's sm_90 compiles of the
  triton platform's fp32 D = 80 kernels (padded to 128; 2026-11-24): the forward
  with 128 x 64 tiles and 3 stages takes 295424 bytes = 3 x 64 x 1 KiB (K, V) +
  64 KiB (Q) + 32 KiB (P) + 512, over an H200's 232448 (it failed to launch); dq
  and dkv with 64 x 64 tiles and 2 stages take 163840 and 164352 = 2 x 64 x 1 KiB
  + 32 KiB (one resident tile) + 0 / 512."""
  itemsize = jnp.dtype(spec.dtype).itemsize
  dq, dv = tile_size(spec.head_dim), tile_size(spec.head_dim_v)
  row_bytes = (dq + dv) * itemsize

  def tile_bytes(shape, itemsize, other):
    # Bytes per streamed row of a [.., Sq, Sk] tile: a full other side is
    # ``other`` wide (counted whichever side streams: an upper bound).
    if shape is None:
      return 0
    return itemsize * (other if min(shape[2], shape[3]) > 1 else 1)

  def fits(c, streamed, other, resident_cols, probs):
    o = getattr(c, other)
    per_row = (row_bytes + tile_bytes(spec.bias_shape, 4, o) +
               tile_bytes(spec.mask_shape, 1, o) + 4 * spec.has_segment_ids)
    pipelined = c.num_stages * getattr(c, streamed) * per_row
    if itemsize < 4:
      return pipelined <= budget
    resident = (o * resident_cols + probs * c.block_q * c.block_kv) * 4
    return pipelined <= budget and pipelined + resident <= budget + RESERVED

  def fit(c, streamed, other, resident_cols, probs=False):
    # The streamed side is halved first; the resident side only where 16
    # streamed rows still do not fit (fp32 wide heads on 64-99 KiB devices).
    while not fits(c, streamed, other, resident_cols, probs):
      side = streamed if getattr(c, streamed) > 16 else other
      if getattr(c, side) <= 16:
        break
      c = dataclasses.replace(c, **{side: getattr(c, side) // 2})
    return c

  wide = max(dq, dv)
  return dataclasses.replace(cfg, fwd=fit(cfg.fwd, "block_kv", "block_q", dq, True),
                             dq=fit(cfg.dq, "block_kv", "block_q", wide),
                             dkv=fit(cfg.dkv, "block_q", "block_kv", wide))
