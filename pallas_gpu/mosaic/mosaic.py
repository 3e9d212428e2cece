"""Entry point of the Pallas Mosaic-GPU platform (Hopper).

Forward: the warp-specialised kernel of fwd.py. Backward: the Mosaic-GPU dQ and
dK/dV kernels of bwd.py (above head dim 128 with the two compute warpgroups of
a CTA sharing one block in roles), on this forward's output and lse. Segment
ids narrow every kernel's walk to the blocks the ids leave visible
(common/segments.py). A bias or dense mask over whole ``[Sq, Sk]`` slices runs
as one additive tile (head dims up to 128; a mask alone as float8 0 / -inf):
the forward streams it with K (128-key blocks beside a float8 or 16-bit tile,
64-key beside an fp32 one or a 16-bit one with segment ids:
config.additive_forwards), the dQ kernel too, writing dS for dbias, and the
dK/dV kernel with Q, reading it transposed; an fp32 bias, whose tile stays
fp32, takes Pallas-Triton's backward. Dropout runs in all three kernels, each
hashing the global coordinates of its tiles with common/dropout.py (the
backward's row keys come with the row stats). Features the kernels lack (fp32,
a bias or mask broadcast along Sq or Sk or with head dims over 128, a mask
with a soft cap) raise NotImplementedError, so the frontend routes those calls
to the next platform (triton where installed, then Pallas-Triton).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ...common import (blocking, configs, dropout, epilogue, hardware, platform,
                       rows, segments, vjp)
from ...common import spec as spec_lib
from ..triton import decode, pallas_triton
from . import autotune, dbias_sum
from .blocks import Geometry, dropout_key_halves, dropout_row_keys, reached_tiles
from .config import (BALANCED_MAX_KEYS, BIAS_MAX_HEAD_DIM, HEAD_DIMS,
                     OWN_BLOCK_BWD_MAX_HEAD_DIM, PACKED_BALANCED_MAX_KEYS, MosaicConfig,
                     MosaicDkv, MosaicDq, MosaicForward, additive_forwards,
                     backward_tiles_error,
                     default_config, has_additive_tile, mask_alone, padded_head_dim,
                     single_pass_applies, single_pass_backward, sums_dbias_in_kernel,
                     uses_mosaic_backward)

NAME = "pallas-mosaic-gpu"
CONFIG = MosaicConfig
DTYPES = ("bfloat16", "float16")
CAPABILITIES = platform.Capabilities(
    dtypes=DTYPES, max_head_dim=HEAD_DIMS[-1], features=frozenset(spec_lib.FEATURES))


def supported(spec: spec_lib.AttentionSpec) -> str | None:
  reason = CAPABILITIES.unsupported(spec)
  if reason:
    return reason
  for name, shape in (("bias", spec.bias_shape), ("mask", spec.mask_shape)):
    if shape is None:
      continue
    if tuple(shape[2:]) != (spec.seq_q, spec.seq_k):
      return f"a {name} broadcast along Sq or Sk (shape {tuple(shape)})"
    if padded_head_dim(spec) > BIAS_MAX_HEAD_DIM:
      return (f"a {name} with head dim {max(spec.head_dim, spec.head_dim_v)} > "
              f"{BIAS_MAX_HEAD_DIM}")
  # The mask rides in the additive tile as -inf, which the soft cap would turn
  # into -cap.
  if spec.mask_shape is not None and spec.logits_soft_cap is not None:
    return "a mask with a soft cap"
  return None


def geometry(spec, config: MosaicConfig) -> Geometry:
  d = padded_head_dim(spec)
  fwd = config.fwd
  tile = 2 * fwd.block_q
  persistent = fwd.persistent
  if persistent is None:
    # The full band, also over packed documents, whose uneven tiles the device
    # balances (blocks.balanced_order): on an H200 (2026-11-26, 16k-32k tokens,
    # H16 D128) 1.00-1.13x one CTA per tile in two runs; every n-th tile was
    # 0.75x on documents of mixed lengths (docs/reports/
    # 2026-11-26-h200-packed-balanced-forward.md).
    persistent = spec.band.is_full
    # Causal tiles up to 8192 keys (packed rows: up to 16384): the hardware
    # scheduler's start-up per CTA costs more than a balanced persistent
    # launch's imbalance (MosaicForward, PACKED_BALANCED_MAX_KEYS).
    most = PACKED_BALANCED_MAX_KEYS if spec.has_segment_ids else BALANCED_MAX_KEYS
    persistent = persistent or (
        spec.band.causal and spec.band.left is None and spec.seq_k <= most)
  # Uneven tiles (a band's, or documents') are balanced; the full band's even
  # ones split their last round instead (split_tail).
  balanced = (persistent and fwd.balanced is not False and
              (not spec.band.is_full or spec.has_segment_ids))
  return Geometry(
      batch=spec.batch, seq_q=spec.seq_q, seq_k=spec.seq_k,
      seq_q_padded=blocking.round_up(spec.seq_q, tile),
      seq_k_padded=blocking.round_up(spec.seq_k, fwd.block_kv),
      heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=d, band=spec.band,
      softmax_scale=spec.softmax_scale, soft_cap=spec.logits_soft_cap,
      block_q=fwd.block_q, block_kv=fwd.block_kv, num_stages=fwd.num_stages,
      dtype=spec.dtype, persistent_ctas=hardware.num_sms() if persistent else 0,
      split_tail=fwd.split_tail and not spec.has_segment_ids,
      balanced=balanced,
      segments=spec.has_segment_ids, segment_spans=spec.contiguous_segments,
      dropout_rate=spec.dropout_rate)


def backward_geometries(spec, config: MosaicConfig) -> tuple[Geometry, Geometry]:
  """dQ and dK/dV geometries over one padding of Sq and Sk, so both kernels read
  the same padded operands."""
  d = padded_head_dim(spec)
  lcm = lambda a, b: a * b // math.gcd(a, b)
  dq, dkv = config.dq, config.dkv
  q_tile = lcm(2 * dq.block_q, dkv.block_q)
  k_tile = lcm(dq.block_kv, 2 * dkv.block_kv)
  common = dict(
      batch=spec.batch, seq_q=spec.seq_q, seq_k=spec.seq_k,
      seq_q_padded=blocking.round_up(spec.seq_q, q_tile),
      seq_k_padded=blocking.round_up(spec.seq_k, k_tile),
      heads_q=spec.heads_q, heads_kv=spec.heads_kv, head_dim=d, band=spec.band,
      softmax_scale=spec.softmax_scale, soft_cap=spec.logits_soft_cap, dtype=spec.dtype,
      segments=spec.has_segment_ids, segment_spans=spec.contiguous_segments,
      dropout_rate=spec.dropout_rate, shared_block=d > OWN_BLOCK_BWD_MAX_HEAD_DIM)
  return (Geometry(block_q=dq.block_q, block_kv=dq.block_kv, num_stages=dq.num_stages,
                   **common),
          Geometry(block_q=dkv.block_q, block_kv=dkv.block_kv,
                   num_stages=dkv.num_stages, **common))


def _tile_dtype(ops, spec):
  """The additive tile's dtype: a mask alone's float8_e5m2, which holds 0 and
  -inf exactly in half a bf16 tile's bytes; an fp32 bias's; else the inputs'."""
  if mask_alone(spec):
    return jnp.dtype(jnp.float8_e5m2)
  if ops.bias.dtype == jnp.float32:
    return jnp.dtype(jnp.float32)
  return ops.q.dtype


def additive_tile(ops, spec, g: Geometry):
  """``(g, tile)``: the bias plus 0 / -inf where the mask is False, padded to
  ``[B|1, H|1, Sqp, Skp]``, fp32 for an fp32 bias, else in the inputs' dtype,
  and ``g`` recording it; ``(g, None)`` without bias and mask."""
  if not has_additive_tile(spec):
    return g, None
  dtype = _tile_dtype(ops, spec)
  tile = None if ops.bias is None else ops.bias.astype(dtype)
  if ops.mask is not None:
    blocked = jnp.where(ops.mask, 0.0, -jnp.inf).astype(dtype)
    tile = blocked if tile is None else tile + blocked
  tile = jnp.pad(tile, ((0, 0), (0, 0), (0, g.seq_q_padded - spec.seq_q),
                        (0, g.seq_k_padded - spec.seq_k)))
  return dataclasses.replace(g, bias_dtype=jnp.dtype(dtype).name,
                             bias_batch=tile.shape[0] > 1,
                             bias_heads=tile.shape[1] > 1), tile


def _pad(x, seq, d):
  return jnp.pad(x, ((0, 0), (0, seq - x.shape[1]), (0, 0), (0, d - x.shape[3])))


def kernel_operands(g: Geometry, q, k, v, do=None):
  """``([q, k, v] (+ [do]), g)``: the kernels' operands, padded to ``g``'s
  lengths and head dim, and ``g`` with their offsets. A ``rows.Rows`` window
  that needs no padding goes as its base, read in place at its offsets (a ring
  hop's K and V in their message, a chunk's q rows); anything else is sliced and
  padded. q and dO share one offset."""
  qs, ks, d = g.seq_q_padded, g.seq_k_padded, g.head_dim
  fits = lambda x, s: isinstance(x, rows.Rows) and x.length == s and x.shape[3] == d
  padded = lambda x, s: _pad(rows.materialize(x), s, d)
  q_side = [q] if do is None else [q, do]
  if all(fits(x, qs) for x in q_side) and len({x.at for x in q_side}) == 1:
    (q, *do), q_at = [x.base for x in q_side], q.at
  else:
    (q, *do), q_at = [padded(x, qs) for x in q_side], (0, 0)
  (k, k_at), (v, v_at) = ((x.base, x.at) if fits(x, ks) else (padded(x, ks), (0, 0))
                          for x in (k, v))
  return [q, k, v, *do], dataclasses.replace(g, q_at=q_at, k_at=k_at, v_at=v_at)


def _pad_ids(ids, seq):
  return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, seq - ids.shape[1])), mode="edge")


def segment_operands(ops, g: Geometry, over_kv: bool = True):
  """The kernels' segment operands, ``()`` without segment ids; else, for the
  kernel's own side (query rows, or with ``over_kv=False`` keys):

  * the own ids ``[B, n]``, or with ``g.segment_spans`` each own position's span
    ``[lo, hi)`` of the other side's positions ``[B, 2, n]`` (segments.spans:
    the band and the real length folded in);
  * the other side's ids ``[B, m]`` (unused with ``g.segment_spans``);
  * per warpgroup block (``block_q`` rows, or ``block_kv`` keys), the blocks of
    the other side that the ids leave visible and the run among them that the
    ids do not mask, ``[B, 4, n / block]`` (lo, hi, one_lo, one_hi); with
    ``g.segment_spans`` from the spans (segments.span_blocks), whose run needs
    no mask at all."""
  if not g.segments:
    return ()
  q_ids = _pad_ids(ops.q_segment_ids, g.seq_q_padded)
  kv_ids = _pad_ids(ops.kv_segment_ids, g.seq_k_padded)
  own, other = (q_ids, kv_ids) if over_kv else (kv_ids, q_ids)
  blocks = (g.block_q, g.block_kv) if over_kv else (g.block_kv, g.block_q)
  if g.segment_spans:
    own = segments.spans(q_ids, kv_ids, g.band, g.seq_q, g.seq_k, over_kv=over_kv)
    return own, other, segments.span_blocks(own, *blocks)
  nq, nk = g.seq_q_padded // g.block_q, g.seq_k_padded // g.block_kv
  q_rng = segments.block_id_ranges(ops.q_segment_ids, g.block_q, nq)
  kv_rng = segments.block_id_ranges(ops.kv_segment_ids, g.block_kv, nk)
  find = segments.visible_kv_blocks if over_kv else segments.visible_q_blocks
  table = jnp.stack(find(q_rng, kv_rng, g.band, g.block_q, g.block_kv) +
                    segments.single_id_blocks(q_rng, kv_rng, over_kv), axis=1)
  return own, other, table


def dropout_words(ops, spec):
  """The kernels' dropout operand: the int32 words of ``dropout.kernel_seed``
  with sequence offsets (a ring hop's), or None without dropout."""
  if not spec.dropout_rate:
    return None
  return dropout.kernel_seed(ops.dropout_seed, positions=True)


@rows.takes_rows
def forward(ops, spec, static: platform.Static):
  # Decode shapes have one q tile per head: the split-KV kernel spreads the keys
  # over the SMs instead (triton/decode.py).
  if decode.applies(spec):
    return decode.forward(rows.materialize(ops), spec, None,
                          hardware.num_sms(), False)
  from . import fwd  # imports Mosaic-GPU lowering only when used
  g, tile = additive_tile(ops, spec, geometry(spec, static.config))
  (q, k, v), g = kernel_operands(g, ops.q, ops.k, ops.v)
  out, lse = fwd.forward(q, k, v, g, segment_operands(ops, g), tile,
                         dropout_words(ops, spec))
  return epilogue.finish_forward(out, lse, spec, ops.sinks)


@rows.takes_rows
def backward(ops, spec, static: platform.Static, out, lse, do, dlse):
  # An fp32 tile's ring slots, with the dS stage, do not fit the dQ kernel's
  # shared memory beside its blocks.
  fp32_tile = has_additive_tile(spec) and _tile_dtype(ops, spec) == jnp.float32
  if not uses_mosaic_backward(spec, static.config) or fp32_tile:
    ops, out, do = rows.materialize((ops, out, do))
    return pallas_triton.backward(ops, spec, platform.Static(static.config.backward),
                                  out, lse, do, dlse)
  from . import bwd  # imports Mosaic-GPU lowering only when used
  g_dq, g_dkv = backward_geometries(spec, static.config)
  sqp = g_dq.seq_q_padded
  row_delta, lse_rows, delta_rows = epilogue.backward_rows(
      rows.materialize(out), rows.materialize(do), dlse, lse, sqp)
  stat_rows = [lse_rows * bwd.LOG2E, delta_rows]
  seed = dropout_words(ops, spec)
  if seed is not None:
    # Each row's dropout key (dropout.row_key) travels with its
    # lse and delta: the dK/dV kernel meets a new block of rows every step and
    # would otherwise hash them there.
    b, h, i = (jnp.arange(n, dtype=jnp.int32).reshape(
        [n if a == ax else 1 for a in range(3)]) for ax, n in
        enumerate(lse_rows.shape))
    stat_rows.extend(dropout_key_halves(dropout_row_keys(seed, b, h, i)))
  stats = jnp.stack(stat_rows, axis=2).astype(jnp.float32)
  if do.dtype != ops.q.dtype:
    do = rows.materialize(do).astype(ops.q.dtype)
  (q, k, v, do), g_dq = kernel_operands(g_dq, ops.q, ops.k, ops.v, do)
  g_dkv = dataclasses.replace(g_dkv, q_at=g_dq.q_at, k_at=g_dq.k_at, v_at=g_dq.v_at)
  seg_dq = segment_operands(ops, g_dq)
  seg_dkv = segment_operands(ops, g_dkv, over_kv=False)
  # The forward's additive tile: the dQ kernel streams it with K, the dK/dV
  # kernel with Q, reading its blocks transposed (its tiles are keys by rows).
  g_dq, tile = additive_tile(ops, spec, g_dq)
  if tile is not None:
    g_dq = dataclasses.replace(g_dq, bias_grad=ops.bias is not None,
                               ds_batch_sum=sums_dbias_in_kernel(spec))
    g_dq = dataclasses.replace(g_dq, ds_reached_only=_ds_reached_only(spec, g_dq))
    g_dkv = dataclasses.replace(g_dkv, bias_dtype=g_dq.bias_dtype,
                                bias_batch=g_dq.bias_batch, bias_heads=g_dq.bias_heads)
  if static.config.bwd_single_pass and single_pass_applies(spec, static.config) is None:
    dq, dk, dv, ds = bwd.single_pass(q, k, v, do, stats, g_dq, g_dkv, seg_dq, seg_dkv,
                                     seed, tile)
  elif static.config.bwd_one_launch:
    dq, dk, dv, ds = bwd.dq_dkv(q, k, v, do, stats, g_dq, g_dkv, seg_dq, seg_dkv,
                                seed, tile)
  else:
    dq, ds = bwd.dq(q, k, v, do, stats, g_dq, seg_dq, seed, tile)
    dk, dv = bwd.dkv(q, k, v, do, stats, g_dkv, seg_dkv, seed, tile)
  dsinks = dbias = None
  if spec.num_sinks:
    dsinks = epilogue.sinks_grad(ops.sinks, lse, row_delta)
  if ops.bias is not None:
    dbias = _dbias(ds, g_dq, spec, ops.bias)
  return spec_lib.Operands(
      q=dq[:, :spec.seq_q, :, :spec.head_dim],
      k=dk[:, :spec.seq_k, :, :spec.head_dim].astype(ops.k.dtype),
      v=dv[:, :spec.seq_k, :, :spec.head_dim_v].astype(ops.v.dtype), bias=dbias,
      sinks=dsinks)


def _dbias(ds, g: Geometry, spec, bias):
  """dbias from the dQ kernel's ``ds``. Where it left the band's unreached
  tiles unwritten, dbias_sum reads only the reached ones: XLA's sum read all
  of dS, zeroing the rest in its read."""
  if not g.ds_reached_only:
    return epilogue.dbias_from_ds(ds, spec, bias)
  summed = dbias_sum.band_sum(ds, reached_tiles(g), bias.shape[0], bias.shape[1],
                              bias.dtype)
  return summed[:, :, :spec.seq_q, :spec.seq_k].reshape(bias.shape)


def _ds_reached_only(spec, g: Geometry) -> bool:
  """Whether the dQ kernel leaves dS's tiles outside the band unwritten
  (``Geometry.ds_reached_only``): where dS is summed over the batch or heads
  outside the kernel, the sum (dbias_sum) skips those tiles, while the
  kernel's zero tiles were half of dS's writes under a causal band. On an H200
  (2026-11-28, bf16 bias, H16 D128) leaving them unwritten made
  forward+backward 1.08x as fast at B2 S8k causal, 1.08x at B4 S4k causal
  (summed over the batch or the heads) and 1.23x under a 2048-key window at
  B2 S8k; the sum's skipping their reads a further 1.04-1.07x and 1.14x.
  Segment ids narrow the walks further on the device, so their kernels still
  write the zeros."""
  if not g.bias_grad or g.ds_batch_sum or g.segments:
    return False
  batch, heads = spec.bias_shape[:2]
  summed = (batch == 1 and spec.batch > 1) or (heads == 1 and spec.heads_q > 1)
  return summed and not reached_tiles(g).all()


def tile_itemsize(ops, spec) -> int | None:
  """The bytes of an element of the additive tile (:func:`additive_tile`),
  None without one: what the forward's tiles must fit beside."""
  return _tile_dtype(ops, spec).itemsize if has_additive_tile(spec) else None


def resolve_config(spec, config: MosaicConfig | None,
                   tile_itemsize: int | None = None) -> MosaicConfig:
  """Explicit, else cached, else tuned (FLASHJAX_AUTOTUNE=1 on a GPU), else the
  heuristic (autotune.py, common/autotune.py; ``tile_itemsize`` as in
  :func:`config.default_config`)."""
  return autotune.TUNER.resolve(spec, config, attention=flash_attention,
                                default=default_config(spec, tile_itemsize),
                                may_tune=jax.default_backend() == "gpu")


def attention_from_operands(ops, spec, config: MosaicConfig | None = None):
  reason = supported(spec)
  if reason:
    raise NotImplementedError(reason)
  if jax.default_backend() != "gpu" or not hardware.is_hopper():
    raise NotImplementedError("needs a Hopper GPU")
  explicit = config is not None
  item = tile_itemsize(ops, spec)
  config = platform.check_config(resolve_config(spec, config, item), MosaicConfig, NAME)
  tiles = lambda c: (c.block_kv, c.num_stages)
  fits = additive_forwards(spec, item)
  if fits and tiles(config.fwd) not in [tiles(f) for f in fits]:
    if explicit:
      what = "a mask" if mask_alone(spec) else "a bias"
      allowed = " or ".join(f"fwd.block_kv={f.block_kv}, fwd.num_stages="
                            f"{f.num_stages}" for f in fits)
      raise ValueError(f"with {what}, the forward's tiles must be {allowed} (the "
                       f"additive tile shares shared memory with the K/V ring), got "
                       f"fwd.block_kv={config.fwd.block_kv}, fwd.num_stages="
                       f"{config.fwd.num_stages}")
    config = configs.with_part(config, "fwd", block_kv=fits[0].block_kv,
                               num_stages=fits[0].num_stages)
  if uses_mosaic_backward(spec, config) and backward_tiles_error(spec, config):
    if explicit:
      raise ValueError(backward_tiles_error(spec, config))
    config = dataclasses.replace(config, dq=MosaicDq(), dkv=MosaicDkv())
  # The Pallas-Triton backward's tiles (an fp32 bias) travel in the config.
  config = dataclasses.replace(config, backward=config.backward or
                               pallas_triton.resolve_config(spec, None, False))
  return vjp.attention(forward, backward, ops, spec, platform.Static(config),
                       per_shard=True)


# The contract minus fp32 and a bias or mask broadcast along Sq or Sk
# (CAPABILITIES, supported).
flash_attention = platform.entry(NAME, attention_from_operands, CAPABILITIES)
