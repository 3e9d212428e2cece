"""Tiles of the Pallas Mosaic-GPU platform (Hopper) and their default: imported by
the platform's entry (mosaic.py) and its autotuning (autotune.py)."""

from __future__ import annotations

import dataclasses

from ...common import configs
from ..triton.plan import TritonConfig

HEAD_DIMS = (64, 128, 256)
BACKWARD_KERNELS = ("mosaic", "triton")
# Up to this head dim each compute warpgroup of the Mosaic backward owns a block;
# above it the two share one in two roles (blocks.Geometry.shared_block).
OWN_BLOCK_BWD_MAX_HEAD_DIM = 128
BIAS_MAX_HEAD_DIM = 128


def _check_stages(cls, num_stages):
  if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 2:
    raise ValueError(f"{cls.__name__}: num_stages must be an int >= 2, got "
                     f"{num_stages!r}")


def _check_in(cls, name, value, allowed, why=""):
  if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
    raise ValueError(f"{cls.__name__}: {name} must be one of {allowed}{why}, got "
                     f"{value!r}")


# One wgmma M tile: the rows (forward, dQ) or keys (dK/dV) a compute warpgroup owns.
WGMMA_M = (64,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicForward:
  """The forward kernel's tiles and launch.

  Attributes:
    block_q: query rows per compute warpgroup (a CTA owns two).
    block_kv: keys per pipeline step.
    num_stages: K/V shared-memory slots in flight.
    persistent: one CTA per SM walking the q tiles (True), one CTA per q tile
      (False), or None: persistent for the full band (with segment ids too),
      for a causal band (no left edge, no ids) with ``seq_k <=
      BALANCED_MAX_KEYS`` and for a causal band over segment ids with
      ``seq_k <= PACKED_BALANCED_MAX_KEYS``; otherwise one CTA per tile. Rows packed
      with documents (full band, H200, 2026-11-26): 1.00-1.13x one CTA per
      tile walked in balanced order, 0.75x on documents of mixed lengths
      walking every ``num_ctas``-th tile.
    split_tail: the persistent forward runs its last, partial round of q tiles
      as key ranges merged by a small second kernel (pallas_gpu/tail_merge.py); applies to
      the full band only, where the plan finds a split that pays. The default
      config turns it on for D <= 64 with more than 2048 keys only. On an H200
      (2026-11-23, device time per call) it made the D = 64 B2 S8k H32 forward
      4.8% faster; at D = 128 it was 1.1% faster at B2 S8k but 1.4% slower at
      B8 S2k and mixed at B1 S16k, so it stays off there.
    balanced: whether a persistent launch over a causal or window band, or
      over segment ids (whose tiles the device orders, since the ids are
      data), walks the tiles of blocks.balanced_order (windows of a few
      heads' tiles, longest first) instead of every ``num_ctas``-th tile,
      whose uneven walks leave CTAs idle (None: it does). On an H200
      (2026-11-26, causal forward, against one CTA per tile): D = 128 B8 S2k
      8-10% faster, B4 S4k 3-5%, B2 S8k 2-5%, B1 S16k even; D = 64 B2 S8k H32
      8%, B1 S16k 3%; D = 256 B8 S2k to B2 S8k H8 5-7% (every
      ``num_ctas``-th tile: 5-34% slower everywhere).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  persistent: bool | None = None
  split_tail: bool = False
  balanced: bool | None = None

  def __post_init__(self):
    _check_in(type(self), "block_q", self.block_q, WGMMA_M, " (one wgmma M tile)")
    _check_in(type(self), "block_kv", self.block_kv, (64, 128, 192, 256))
    _check_stages(type(self), self.num_stages)
    if self.persistent is not None and not isinstance(self.persistent, bool):
      raise ValueError(f"MosaicForward: persistent must be None or a bool, got "
                       f"{self.persistent!r}")
    if not isinstance(self.split_tail, bool):
      raise ValueError(f"MosaicForward: split_tail must be a bool, got "
                       f"{self.split_tail!r}")
    if self.balanced is not None and not isinstance(self.balanced, bool):
      raise ValueError(f"MosaicForward: balanced must be None or a bool, got "
                       f"{self.balanced!r}")


# The default persistent, balanced causal forward's reach (MosaicForward.persistent):
# in the windowed order it paid at every seq_k up to 8192 measured at D = 64, 128
# and 256, and was even with one CTA per tile at 16384, D = 128 (H200,
# 2026-11-26, docs/reports/2026-11-26-h200-windowed-balanced-order.md).
BALANCED_MAX_KEYS = 8192
# The same for causal rows packed with documents, whose walks are at most a
# document long. Rows of 16384 keys (documents of 8 x 2048, 32 x 512 and mixed
# lengths up to 8192) ran 1.02-1.04x one CTA per tile per forward call and
# 1.01-1.06x per call in a chain of four (H200, 2026-11-27, with the order
# ranked on the device: docs/reports/2026-11-27-h200-packed-order.md). A row
# of one document walks as the causal band above, where the balanced launch
# was even with one CTA per tile at 16384 without ids (not measured with ids).
PACKED_BALANCED_MAX_KEYS = 16384

# The forward's additive tile shares shared memory with the K/V ring
# (fwd.smem_bytes): 64-key blocks in two stages fit beside any tile; 128-key
# blocks in two stages beside a mask alone's float8 tile (segment ids' buffers
# too) and beside a 16-bit tile (a bias in the inputs' dtype), but not beside a
# 16-bit tile and the buffers of segment ids streamed per slot. (With
# contiguous segments' spans instead of streamed ids they would fit; not
# measured, so any segment ids keep 64-key blocks beside a 16-bit tile.)
NARROW_FORWARD = MosaicForward(block_kv=64, num_stages=2)
WIDE_FORWARD = MosaicForward(block_kv=128, num_stages=2)


def additive_forwards(spec, tile_itemsize: int | None) -> tuple[MosaicForward, ...]:
  """The forward tiles that fit beside ``spec``'s additive tile of
  ``tile_itemsize``-byte elements (``mosaic.tile_itemsize``; a mask alone's
  is float8; None, a bias's unknown: those that fit beside any tile), the
  default first; empty without one. 128-key blocks where they
  fit: on an H200 (2026-11-28, B8 S2k and B2 S8k, H16 D128, causal or not) the
  forward ran 1.06-1.18x faster than with 64-key blocks beside a mask's tile
  (docs/reports/2026-11-28-h200-mask-tile.md), 1.06-1.17x beside a bf16
  bias's (docs/reports/2026-11-28-h200-bias-forward-tile.md)."""
  if not has_additive_tile(spec):
    return ()
  if mask_alone(spec) or (tile_itemsize == 2 and not spec.has_segment_ids):
    return (WIDE_FORWARD, NARROW_FORWARD)
  return (NARROW_FORWARD,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicDq:
  """The dQ kernel's tiles: ``block_q`` rows per compute warpgroup (a CTA owns
  two), ``block_kv`` keys per pipeline step, ``num_stages`` K/V slots in
  flight."""

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2

  def __post_init__(self):
    _check_in(type(self), "block_q", self.block_q, WGMMA_M, " (one wgmma M tile)")
    _check_in(type(self), "block_kv", self.block_kv, (64, 128))
    _check_stages(type(self), self.num_stages)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicDkv:
  """The dK/dV kernel's tiles: ``block_kv`` keys per compute warpgroup (a CTA
  owns two), ``block_q`` query rows per pipeline step, ``num_stages`` Q/dO slots
  in flight."""

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2

  def __post_init__(self):
    # dK += dS^T Q contracts over the q rows: Mosaic-GPU wants 64-multiples (32
    # once passed validation and failed inside Mosaic-GPU).
    _check_in(type(self), "block_q", self.block_q, (64, 128))
    _check_in(type(self), "block_kv", self.block_kv, WGMMA_M, " (one wgmma M tile)")
    _check_stages(type(self), self.num_stages)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """Forward and backward tiles; ``backward`` configures the Pallas-Triton
  backward where that one runs.

  Attributes:
    fwd: the forward kernel (:class:`MosaicForward`).
    dq: the dQ kernel (:class:`MosaicDq`).
    dkv: the dK/dV kernel (:class:`MosaicDkv`).
    backward_kernel: "mosaic" (the Mosaic-GPU dQ and dK/dV kernels; above
      D = 128 or with a bias or mask, the default tiles only, see
      :func:`fixed_backward_tiles`)
      or "triton" (Pallas-Triton's backward).
    bwd_one_launch: run the dQ and dK/dV kernels as one launch (one grid tail
      instead of two) rather than one after the other. The default config
      picks two launches where they were measured faster
      (:func:`two_launch_backward`).
    bwd_single_pass: compute dQ in the dK/dV kernel too (FlashAttention-3's
      backward: five block products per step instead of seven), each CTA
      adding its fp32 share into dQ with TMA reduce-adds. Those adds land in
      any order, so dQ's last bits may vary between runs (dK and dV do not):
      set it False for bit-reproducible gradients. Applies where
      :func:`single_pass_applies`; elsewhere, and under ``vmap``, the two
      kernels run. The default config turns it on where it was measured
      faster (:func:`single_pass_backward`).
    backward: the Pallas-Triton backward's config where that one runs (resolved
      by that platform when None).
  """

  fwd: MosaicForward = MosaicForward()
  dq: MosaicDq = MosaicDq()
  dkv: MosaicDkv = MosaicDkv()
  backward_kernel: str = "mosaic"
  bwd_one_launch: bool = True
  bwd_single_pass: bool = False
  backward: TritonConfig | None = None

  def __post_init__(self):
    configs.check_parts(self)
    if self.backward_kernel not in BACKWARD_KERNELS:
      raise ValueError(f"backward_kernel must be one of {BACKWARD_KERNELS}, got "
                       f"{self.backward_kernel!r}")
    if not isinstance(self.bwd_one_launch, bool):
      raise ValueError(f"bwd_one_launch must be a bool, got {self.bwd_one_launch!r}")
    if not isinstance(self.bwd_single_pass, bool):
      raise ValueError(f"bwd_single_pass must be a bool, got {self.bwd_single_pass!r}")
    if self.backward is not None and type(self.backward) is not TritonConfig:
      raise ValueError(f"backward must be a TritonConfig or None, got "
                       f"{self.backward!r}")


def to_json(cfg: MosaicConfig) -> dict:
  """The Mosaic fields as nested dicts (the Pallas-Triton ``backward`` is that
  platform's to resolve and cache)."""
  d = dataclasses.asdict(cfg)
  d.pop("backward")
  return d


def from_json(d: dict) -> MosaicConfig:
  """The inverse of :func:`to_json`; a missing part or field takes its default.
  Unknown fields (an entry of an older layout) raise ``TypeError``
  (common/configs.py)."""
  return configs.from_dict(MosaicConfig, d)


def padded_head_dim(spec) -> int | None:
  d = max(spec.head_dim, spec.head_dim_v)
  return next((x for x in HEAD_DIMS if x >= d), None)


def default_config(spec, tile_itemsize: int | None = None) -> MosaicConfig:
  """Shared memory holds 2 q blocks and ``num_stages`` K and V blocks: D = 256
  keeps 64-key blocks so two stages fit in 227 KiB. Beside an additive tile,
  the first of :func:`additive_forwards` for ``tile_itemsize``. The split tail
  only where it was measured to pay (D = 64, long keys; see MosaicForward)."""
  d = padded_head_dim(spec) or 256
  if has_additive_tile(spec):
    fwd = additive_forwards(spec, tile_itemsize)[0]
  elif d <= 64:
    fwd = MosaicForward(block_kv=128, num_stages=3, split_tail=spec.seq_k > 2048)
  elif d <= 128:
    fwd = MosaicForward(block_kv=128, num_stages=2)
  else:
    fwd = MosaicForward(block_kv=64, num_stages=2)
  return MosaicConfig(fwd=fwd, bwd_one_launch=not two_launch_backward(spec),
                      bwd_single_pass=single_pass_backward(spec))


# From this many queries and keys a full-band D = 128 backward runs as two
# launches.
TWO_LAUNCH_MIN_LENGTH = 8192


def two_launch_backward(spec) -> bool:
  """Whether the default backward runs the dQ and dK/dV kernels as two launches:
  over the full band at D = 128 with at least ``TWO_LAUNCH_MIN_LENGTH`` queries
  and keys, no additive tile and no dropout. On an H200 (2026-11-27, fwd+bwd,
  three runs) two launches were 1.3-3.4% faster there (B2 S8k, B1 S16k, GQA
  32:8 B2 S8k; 0.7% on one run of a 16k row packed with 8 documents).
  Elsewhere they were within -3.0%..+2.1% of one launch: causal bands, B8 S2k,
  D = 64 and packed causal rows; and 1.7-2.0% slower at B1 H16 with 4096
  queries and 8192 keys (two runs, a ring hop's call). So those keep one
  launch, as do calls with an additive tile or dropout, which were not
  measured."""
  return (padded_head_dim(spec) == 128 and spec.band.is_full
          and min(spec.seq_q, spec.seq_k) >= TWO_LAUNCH_MIN_LENGTH
          and not has_additive_tile(spec) and not spec.dropout_rate)


# From this many queries and keys a full-band D = 128 backward runs as one pass.
SINGLE_PASS_MIN_LENGTH = 2048


def single_pass_backward(spec) -> bool:
  """Whether the default backward is the single pass
  (``MosaicConfig.bwd_single_pass``): over the full band at D = 128 with one
  query head per kv head, from ``SINGLE_PASS_MIN_LENGTH`` queries and keys,
  with or without dropout, and without segment ids, an additive tile or a soft
  cap. On an H200 (backward alone, against the two kernels in one process):
  - 2026-11-29 (docs/reports/2026-11-29-h200-single-pass-backward.md): 1.05x
    as fast at B8 S2k, 1.09x at B2 S8k and 1.14x at B1 S16k (H16); with
    dropout 0.1 1.10x at B8 S2k and 1.20x at B2 S8k
    (docs/reports/2026-11-29-h200-single-pass-dropout-mask.csv).
  - Slower with a causal band (0.76-0.90x at D = 128: ptxas serializes its
    wgmmas, docs/reports/2026-11-29-h200-causal-single-pass-serialization.md),
    at D = 64 over the full band (0.97x), with grouped heads (GQA 32:8: 0.93x,
    causal 0.75x) and with a dense mask (0.97x at B8 S2k, 1.02x at B2 S8k), so
    those keep the two kernels. D = 64 causal was 1.08x but is one shape.
  - Slower with segment ids: one packed row of 16k tokens, full band, 0.77x
    at 8 documents of 2048 and 0.85x at mixed lengths (2026-11-29,
    docs/reports/2026-11-29-h200-single-pass-segment-ids.csv). A soft cap was
    not timed with it."""
  return (padded_head_dim(spec) == 128 and spec.band.is_full
          and spec.heads_q == spec.heads_kv
          and min(spec.seq_q, spec.seq_k) >= SINGLE_PASS_MIN_LENGTH
          and not spec.has_segment_ids and not has_additive_tile(spec)
          and spec.logits_soft_cap is None)


def has_additive_tile(spec) -> bool:
  """A bias or dense mask: the kernels stream one additive tile."""
  return spec.bias_shape is not None or spec.mask_shape is not None


def mask_alone(spec) -> bool:
  """A dense mask without a bias: its additive tile holds only 0 and -inf, so
  it travels as float8 (``mosaic.additive_tile``) and leaves room for the
  forward's 128-key blocks (:func:`additive_forwards`)."""
  return spec.mask_shape is not None and spec.bias_shape is None


# From this many batch rows the dQ kernel sums a batch-broadcast bias's dS
# itself (see sums_dbias_in_kernel).
DBIAS_KERNEL_SUM_MIN_BATCH = 8


def sums_dbias_in_kernel(spec) -> bool:
  """Whether the dQ kernel sums dS over the batch for a bias broadcast over it
  (``Geometry.ds_batch_sum``) instead of writing a ``[B, H, Sq, Sk]`` dS that
  XLA sums. Per element of dbias the kernel's sum moves about 18 bytes (the
  zeroed fp32 accumulator written, read back into L2 by the first add and
  written back, XLA's read of it and dbias's write) against ``4 * B + 2`` for a
  bf16 dS per row: even at B = 4. On an H200 (2026-11-28, forward+backward,
  H16 D128, sequence lengths of 512 to 2048 at 8 rows or more) it was
  1.00-1.03x as fast at B8 S2k and 1.13-1.14x causal, 1.07x at B16 S1k and
  1.19x causal, 1.10x at B32 S512 causal; at B4 S4k 0.97-0.99x (1.07x causal)
  and at B2 S8k 0.85-0.86x. Those per-row timings predate the dQ kernel
  leaving tiles outside the band unwritten (mosaic._ds_reached_only), which
  made the per-row path 1.08x as fast at B4 S4k causal, about the sum's edge
  there; causal rows from 8 were not timed again. Its fp32 sum also cut
  dbias's error against an fp32 reference 1.9-4x."""
  return (spec.bias_shape is not None and spec.bias_shape[0] == 1
          and spec.batch >= DBIAS_KERNEL_SUM_MIN_BATCH)


def fixed_backward_tiles(spec) -> str | None:
  """Why the Mosaic backward's tiles must be the defaults for ``spec``, or None.
  Above D = 128 a dQ CTA holds its 64 rows of Q and dO and two stages of 64-key
  K and V blocks, a dK/dV CTA its 64 keys of K and V and two stages of 64-row Q
  and dO blocks: 192 KiB of the 227 at D = 256. With an additive tile the dQ
  kernel holds two stages of its 64 x 64 tiles and a dS stage (bf16 with a
  bf16 tile, 177 KiB in all; fp32 with an fp16 tile or for the batch sum,
  193 KiB) beside its D = 128 blocks. Any larger block or a third stage did
  not fit beside the fp32 stage; beside the bf16 one that is not measured."""
  if padded_head_dim(spec) > OWN_BLOCK_BWD_MAX_HEAD_DIM:
    return f"above head dim {OWN_BLOCK_BWD_MAX_HEAD_DIM}"
  if has_additive_tile(spec):
    return "with a bias or mask"
  return None


def backward_tiles_error(spec, config: MosaicConfig) -> str | None:
  """The error for ``config``'s backward tiles where :func:`fixed_backward_tiles`
  applies and they are not the defaults, or None."""
  why = fixed_backward_tiles(spec)
  if why is None or (config.dq, config.dkv) == (MosaicDq(), MosaicDkv()):
    return None
  return (f"{why} the Mosaic backward's tiles must be dq={MosaicDq()} and "
          f"dkv={MosaicDkv()} (larger ones do not fit shared memory), got "
          f"dq={config.dq}, dkv={config.dkv}")


def single_pass_applies(spec, config: MosaicConfig | None = None) -> str | None:
  """Why ``MosaicConfig.bwd_single_pass`` cannot apply to ``spec`` (with
  ``config``'s dK/dV tiles), or None: it needs each compute warpgroup to own
  its keys (head dims up to ``OWN_BLOCK_BWD_MAX_HEAD_DIM``), no dS output (no
  bias; a dense mask alone is fine) and the default dK/dV tiles. Its dS^T
  buffers and fp32 dQ staging tiles take 64 KiB of shared memory at D = 128
  beside the default tiles' 129 KiB; with 128-row Q blocks they would need
  320 KiB in all, over Hopper's 227, and with a third stage 224, at its edge
  (neither compiled)."""
  if padded_head_dim(spec) > OWN_BLOCK_BWD_MAX_HEAD_DIM:
    return f"above head dim {OWN_BLOCK_BWD_MAX_HEAD_DIM}"
  if spec.bias_shape is not None:
    return "with a bias (dbias takes the dQ kernel's dS)"
  if config is not None and config.dkv != MosaicDkv():
    return f"with dK/dV tiles other than {MosaicDkv()}, got {config.dkv}"
  return None


def uses_mosaic_backward(spec, config: MosaicConfig) -> bool:
  """Whether the Mosaic dQ and dK/dV kernels run (mosaic.backward also sends an
  fp32 bias to Pallas-Triton's)."""
  return config.backward_kernel == "mosaic"
