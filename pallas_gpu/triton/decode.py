"""Pallas-Triton split-KV forward for few queries against many keys (decode).

A decode step has one q block per (batch, head), so the training forward, which
parallelises over q blocks, leaves most SMs idle while it streams the cache. Here
(FlashDecoding):

- the q rows of all heads of one kv head form the tile's rows (``group_size *
  seq_q`` of them), so each K/V tile is read once per kv head. Where both counts
  are powers of two filling 16-64 rows (:func:`direct`) the kernel reads them as
  the ``[Sq, G, D]`` block of q (row ``s * G + g`` for query ``s`` of head ``g``)
  and writes out and lse in the call's layout; otherwise XLA packs q first
  (``kvcache.group_queries``: row ``g * Sq + s``, padded to 16 rows) and unpacks
  the results;
- the grid is (splits, B, Hkv): each program runs the online softmax over its own
  share of the key tiles and writes a normalised partial output (fp32) and its lse;
- ``combine`` merges the splits exactly through their lse in XLA (a few MB against
  the GBs of cache read); a direct call with one split and no sinks
  (:func:`final`) writes its output in q's dtype and needs no merge.

Keys are read straight from ``[B, Sk, Hkv, D]`` with no padding copy: a ragged
last tile is read from ``Sk - block_kv`` (overlapping the previous one) and the
keys already counted are masked out. Only tiles that the band or that ragged end
cuts are masked (``blocking.kv_block_range``); the rest run without the mask.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...common import blocking, epilogue, hardware
from ...common import kvcache as kv
from ...common.blocking import LN2, LOG2E
from ...common import spec as spec_lib

# Rows of the q tile (either layout): the fp32 accumulator of 64 rows x 128
# columns is 64 registers per thread over 4 warps.
MAX_ROWS = 64
MIN_ROWS = 16  # the smallest M of a tensor-core product in Triton
HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """``num_splits``: key splits per (batch, kv head); 0 chooses from the SM count.
  Each stage holds one K and one V tile in shared memory (:func:`fit`)."""

  block_kv: int = 128
  num_splits: int = 0
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    if self.block_kv not in (16, 32, 64, 128, 256):
      raise ValueError(f"block_kv must be a power of two in 16..256, got "
                       f"{self.block_kv}")
    if not isinstance(self.num_splits, int) or self.num_splits < 0:
      raise ValueError(f"num_splits must be an int >= 0, got {self.num_splits!r}")


def applies(spec: spec_lib.AttentionSpec) -> bool:
  """Whether a call is decode-shaped and within this kernel's features: few packed
  rows, power-of-two heads, and no per-element operand (bias, mask, segment ids,
  dropout), which the training forward handles."""
  rows = spec.seq_q * spec.group_size
  return (rows <= MAX_ROWS and spec.seq_k >= 4 * MIN_ROWS and spec.seq_k >= 2 * rows
          and spec.head_dim in HEAD_DIMS and spec.head_dim_v in HEAD_DIMS
          and spec.bias_shape is None and spec.mask_shape is None
          and not spec.has_segment_ids and spec.dropout_rate == 0)


def packed_rows(spec) -> int:
  """Rows of the q tile, in either layout: the call's queries times the q heads
  of a kv head, a power of two of at least ``MIN_ROWS``."""
  return max(MIN_ROWS, 1 << (spec.seq_q * spec.group_size - 1).bit_length())


def direct(spec) -> bool:
  """Whether the kernels read q and write out and lse in the call's own layout
  (``[B, Sq, Hq, ..]``): the queries and the q heads of a kv head are powers of
  two (the sizes of Triton's tiles) and fill at least ``MIN_ROWS`` rows. The q
  tile is then the ``[Sq, G, D]`` block of one kv head's heads, its rows
  query-major (:func:`kvcache.query_of_row`). Otherwise XLA packs q by
  ``kvcache.group_queries`` and unpacks the results, two transposes that cost
  3.8 us each around a 129 us kernel at B32 Sq16 Sk4k GQA 32:8 (H200,
  2026-11-26)."""
  sq, g = spec.seq_q, spec.group_size
  return (sq & (sq - 1) == 0 and g & (g - 1) == 0
          and MIN_ROWS <= sq * g <= MAX_ROWS)


def _block_kv(spec, cfg: DecodeConfig) -> int:
  # A tile must fit inside the keys: the ragged tile is read from Sk - block_kv.
  return min(cfg.block_kv, 1 << (spec.seq_k.bit_length() - 1))


def default_config(spec: spec_lib.AttentionSpec) -> DecodeConfig:
  """Tiles by packed rows. H200 sweeps (2026-11-24, bf16, GQA 32:8, D = 128,
  docs/reports/2026-11-24-h200-decode-split-sweep.txt and
  2026-11-24-h200-decode-rows-sweep.txt): 64-key tiles were best at 32-64 rows
  (Sq = 16: 3378 GB/s against 2813 with 128-key tiles), 3 stages ahead of 2 in the
  second sweep (B32 Sq8 Sk4k 3735 against 3149 GB/s, B64 Sq16 Sk8k 4035 against
  3657; 8 warps lost everywhere); 128-key 3-stage tiles within 2% of the best at
  16 rows. At 64 rows, 32-key tiles in 4 stages read 1.1-2.1% more than 64-key
  tiles in 3 at B32 Sk4k, B64 Sk8k, B8 Sk16k and B4 Sk64k (Sq = 16), 0.3% less
  at B16 Sk8k, over two runs (2026-11-25,
  docs/reports/2026-11-25-h200-decode-sq16-tiles.txt). In 3 stages they read
  19% less at B64 Sk8k, in 6 or 8 stages 2-16% less, and at 32 rows 12% less
  than 64-key tiles."""
  rows = packed_rows(spec)
  if rows > 32:
    return DecodeConfig(block_kv=32, num_stages=4)
  if rows > 16:
    return DecodeConfig(block_kv=64, num_stages=3)
  return DecodeConfig(block_kv=128, num_stages=3)


def shared_bytes(cfg: DecodeConfig, spec, rows: int) -> int:
  """Shared memory of the kernel: ``num_stages`` K and V tiles and the q tile; fp32
  products also stage the probabilities. It reproduces the 278528 bytes Triton
  asked for at 64 rows, 128-key tiles, 4 stages, bf16, D = 128 (H200,
  2026-11-24)."""
  item = 4 if spec.dtype == "float32" else 2
  tiles = cfg.num_stages * cfg.block_kv * (spec.head_dim + spec.head_dim_v) * item
  extra = rows * cfg.block_kv * 4 if item == 4 else 0
  return tiles + rows * spec.head_dim * item + extra


def fit(cfg: DecodeConfig, spec, rows: int, budget: int | None = None) -> DecodeConfig:
  """``cfg`` with fewer stages (down to 2), then shorter key tiles, until
  :func:`shared_bytes` fits ``budget`` (default: the device's shared memory less
  4 KiB): wide heads and fp32 overflow the tiles tuned on bf16 at D = 128."""
  if budget is None:
    budget = hardware.gpu_target().shared_memory - 4096
  while shared_bytes(cfg, spec, rows) > budget:
    if cfg.num_stages > 2:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    elif cfg.block_kv > MIN_ROWS:
      cfg = dataclasses.replace(cfg, block_kv=cfg.block_kv // 2)
    else:
      break
  return cfg


def num_splits(spec, cfg: DecodeConfig, sms: int) -> int:
  """``cfg.num_splits``, else about two programs per SM, each split keeping at
  least two tiles. The same sweep: B64 Sk8k (512 programs) was best unsplit, B8
  Sk64k with 4 splits (4357 GB/s; 18 gave 4162), B1 Sk128k with 33 (3675 vs 3484
  at 132)."""
  tiles = blocking.kv_block_range(spec.band, 0, spec.seq_q, _block_kv(spec, cfg))
  blocks = max(int(tiles.last_end - tiles.first), 1)
  return splits_for(cfg, spec, blocks, sms)


def splits_for(cfg: DecodeConfig, spec, blocks: int, sms: int) -> int:
  """Key splits over ``blocks`` key tiles: ``cfg.num_splits`` (at most one per
  tile), or (0) about two programs per SM over the (batch, kv head) programs,
  each split keeping at least two tiles, at most 256."""
  if cfg.num_splits:
    return max(1, min(cfg.num_splits, blocks))
  programs = spec.batch * spec.heads_kv
  return max(1, min(2 * sms // programs, blocks // 2 or 1, 256))


def run_split(q, j0, j1, tile, plain, *, spec, rows, precision):
  """One program's online softmax over key tiles ``[j0, j1)`` of its split:
  ``(out [rows, Dv], lse [rows])``, its normalised fp32 partial output and lse
  (natural log, -inf if it saw no key), for :func:`store`.
  ``tile(j, masked) -> (k, v, ok)`` loads tile ``j``; with ``masked`` also its
  ``[rows, block]`` mask, and the values of masked keys must then be finite
  (they meet p = 0 in the product). Tiles in ``plain = (a, b)`` are ones every
  query sees whole: they run with ``masked=False`` (``ok`` unused), so the
  common tile does no compares or selects. Padding rows of the packed q see
  them too; their rows are dropped. ``plain=None``: every tile is plain (one
  loop). Shared by this kernel and the KV-cache one (kvcache.py)."""
  cap = spec.logits_soft_cap
  # With a cap the logits are scaled before tanh; without, the scale rides in the
  # exp2 argument.
  scale2 = LOG2E if cap is not None else spec.softmax_scale * LOG2E

  def body(masked, j, carry):
    acc, m, l = carry
    k, v, ok = tile(j, masked)
    s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
    if cap is not None:
      s = cap * jnp.tanh(s * (spec.softmax_scale / cap))
    if masked:
      s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    # A row with nothing allowed yet keeps m = -inf; shift by 0 so exp2 gives 0.
    # After a plain tile every row's maximum is finite.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    p = jnp.exp2(s * scale2 - (m_safe * scale2)[:, None])
    alpha = jnp.exp2((m - m_safe) * scale2)
    l = l * alpha + p.sum(axis=1)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                         preferred_element_type=jnp.float32)
    return acc, m_new, l

  init = (jnp.zeros((rows, spec.head_dim_v), jnp.float32),
          jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
  if plain is None:
    acc, m, l = jax.lax.fori_loop(j0, j1, functools.partial(body, False), init)
  else:
    a = jnp.minimum(jnp.maximum(plain[0], j0), j1)
    b = jnp.minimum(jnp.maximum(plain[1], a), j1)
    carry = jax.lax.fori_loop(j0, a, functools.partial(body, True), init)
    carry = jax.lax.fori_loop(a, b, functools.partial(body, False), carry)
    acc, m, l = jax.lax.fori_loop(b, j1, functools.partial(body, True), carry)
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  return acc / safe_l[:, None], jnp.where(
      nonempty, m_safe * scale2 * LN2 + jnp.log(safe_l), -jnp.inf)


def store(o_ref, lse_ref, out, lse, spec):
  """A program's ``out [rows, Dv]`` and ``lse [rows]`` into its blocks of
  :func:`launch`'s outputs: as they are (packed rows), or (:func:`direct`) as
  the ``[Sq, G, Dv]`` and ``[G, Sq]`` blocks of the call's own layout."""
  if direct(spec):
    sq, g = spec.seq_q, spec.group_size
    o_ref[...] = out.reshape(sq, g, out.shape[-1]).astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(sq, g).T
  else:
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, spec, bk, tiles, per, rows,
            precision):
  split = pl.program_id(0)
  band = spec.band

  def tile(j, masked):
    if not masked:
      return k_ref[pl.ds(j * bk, bk), :], v_ref[pl.ds(j * bk, bk), :], None
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
    diag = kv.query_of_row(row, spec, direct(spec)) + band.offset
    start = jnp.minimum(j * bk, spec.seq_k - bk)
    pos = start + col
    ok = (row < spec.seq_q * spec.group_size) & (pos >= j * bk)
    if band.right is not None:
      ok &= pos <= diag + band.right
    if band.left is not None:
      ok &= pos >= diag - band.left
    return k_ref[pl.ds(start, bk), :], v_ref[pl.ds(start, bk), :], ok

  first, last = int(tiles.first), int(tiles.last_end)
  plain = (int(tiles.first_full), int(tiles.last_full_end))
  j0 = first + split * per
  out, lse = run_split(load_q(q_ref, spec), j0, jnp.minimum(j0 + per, last),
                       tile, None if plain == (first, last) else plain, spec=spec,
                       rows=rows, precision=precision)
  store(o_ref, lse_ref, out, lse, spec)


def q_operand(q, spec, rows: int):
  """``(array, BlockSpec)`` of the q rows for grid ``(split, batch, kv head)``:
  the call's q itself where :func:`direct`, else q packed by
  ``kvcache.group_queries`` and padded to ``rows``."""
  sq, d = q.shape[1], q.shape[3]
  if direct(spec):
    return q, pl.BlockSpec((None, sq, spec.group_size, d),
                           lambda s, i, h: (i, 0, h, 0))
  packed = jnp.pad(kv.group_queries(q, spec),
                   ((0, 0), (0, 0), (0, rows - spec.group_size * sq), (0, 0)))
  return packed, pl.BlockSpec((None, None, rows, d), lambda s, i, h: (i, h, 0, 0))


def load_q(q_ref, spec):
  """The program's ``[rows, D]`` q tile from its :func:`q_operand` block."""
  q = q_ref[...]
  return q.reshape(spec.seq_q * spec.group_size, q.shape[-1]) if direct(spec) else q


def partials(q, k, v, spec, cfg: DecodeConfig, splits: int, interpret: bool):
  """The kernel's per-split outputs (:func:`launch`) over ``[B, Sk, Hkv, D]``."""
  d, dv = spec.head_dim, spec.head_dim_v
  rows = packed_rows(spec)
  bk = _block_kv(spec, cfg)
  # A ragged last tile (read from Sk - bk) holds keys already counted: never
  # plain (strict_kv).
  tiles = blocking.kv_block_range(spec.band, 0, spec.seq_q, bk)
  first, last = int(tiles.first), int(tiles.last_end)
  per = -(-(last - first) // splits) if last > first else 0
  q, q_spec = q_operand(q, spec, rows)
  precision = jax.lax.Precision.HIGHEST if spec.dtype == "float32" else None
  kernel = functools.partial(_kernel, spec=spec, bk=bk, tiles=tiles, per=per,
                             rows=rows, precision=precision)
  in_specs = [q_spec,
              pl.BlockSpec((None, spec.seq_k, None, d), lambda s, i, h: (i, 0, h, 0)),
              pl.BlockSpec((None, spec.seq_k, None, dv), lambda s, i, h: (i, 0, h, 0))]
  return launch(kernel, in_specs, (q, k, v), batch=spec.batch, spec=spec, cfg=cfg,
                splits=splits, rows=rows, interpret=interpret,
                name="flashjax_pallas_triton_decode", out_dtype=q.dtype)


def final(spec, splits: int) -> bool:
  """Whether the kernel's one split writes the call's results: in the call's
  layout (:func:`direct`), with no sinks to add in fp32 first. Then the outputs
  are in q's dtype and :func:`combine` has nothing to do."""
  return splits == 1 and direct(spec) and not spec.num_sinks


def launch(kernel, in_specs, args, *, batch, spec, cfg: DecodeConfig, splits: int,
           rows: int, interpret: bool, name: str, out_dtype):
  """The split-KV launch of the decode kernels (here and kvcache.py): one program
  per (split, batch row, kv head) writing that split's normalised ``out`` and
  ``lse`` (natural log) for :func:`combine`. Packed rows: ``out [splits, B, Hkv,
  rows, Dv]`` and ``lse [splits, B, Hkv, rows]``; :func:`direct`: ``out
  [splits, B, Sq, Hq, Dv]`` and ``lse [splits, B, Hq, Sq]``. fp32, or
  ``out_dtype`` where :func:`final`."""
  hkv, dv, sq, g = spec.heads_kv, spec.head_dim_v, spec.seq_q, spec.group_size
  if direct(spec):
    out_specs = [pl.BlockSpec((None, None, sq, g, dv), lambda s, i, h: (s, i, 0, h, 0)),
                 pl.BlockSpec((None, None, g, sq), lambda s, i, h: (s, i, h, 0))]
    shapes = (splits, batch, sq, spec.heads_q, dv), (splits, batch, spec.heads_q, sq)
  else:
    out_specs = [pl.BlockSpec((None, None, None, rows, dv),
                              lambda s, i, h: (s, i, h, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda s, i, h: (s, i, h, 0))]
    shapes = (splits, batch, hkv, rows, dv), (splits, batch, hkv, rows)
  o_dtype = out_dtype if final(spec, splits) else jnp.float32
  return pl.pallas_call(
      kernel,
      grid=(splits, batch, hkv),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct(shapes[0], o_dtype),
                 jax.ShapeDtypeStruct(shapes[1], jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret, name=name,
  )(*args)


def combine(out_parts, lse_parts, spec):
  """The splits of :func:`launch` merged through their lse: ``out [B, Sq, Hq,
  Dv]`` (fp32, or as written where :func:`final`) and ``lse [B, Hq, Sq]``; rows
  no split reached give 0 and -inf."""
  if final(spec, out_parts.shape[0]):
    return out_parts[0], lse_parts[0]
  lse = jax.nn.logsumexp(lse_parts, axis=0)
  w = jnp.where(jnp.isfinite(lse), jnp.exp(lse_parts - lse), 0.0)
  if direct(spec):
    # w [splits, B, Hq, Sq] against out [splits, B, Sq, Hq, Dv].
    return jnp.sum(jnp.swapaxes(w, 2, 3)[..., None] * out_parts, axis=0), lse
  out = jnp.sum(w[..., None] * out_parts, axis=0)
  real = spec.seq_q * spec.group_size
  return kv.ungroup(out[:, :, :real], lse[:, :, :real], spec)


def forward(ops: spec_lib.Operands, spec: spec_lib.AttentionSpec,
            cfg: DecodeConfig | None, sms: int, interpret: bool):
  """``(out, lse)`` of a decode-shaped call (:func:`applies`), sinks included;
  ``cfg`` None takes :func:`default_config`."""
  cfg = cfg or fit(default_config(spec), spec, packed_rows(spec))
  splits = num_splits(spec, cfg, sms)
  o, lse = partials(ops.q, ops.k, ops.v, spec, cfg, splits, interpret)
  out, lse = combine(o, lse, spec)
  # Sinks rescale in fp32 before the one rounding to the input dtype.
  out, lse = epilogue.finish_forward(out, lse, spec, ops.sinks)
  return out.astype(ops.q.dtype), lse
