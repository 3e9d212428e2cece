"""Pallas-Triton split-KV decode over a KV cache (``flash_mha_with_kvcache``).

The decode kernel of decode.py, reading a cache instead of ``[B, Sk, ..]``
keys: each program reads its batch row's key range ``[lo, hi)`` (leftpad, length,
window: ``common.kvcache.key_range``), its cache row (``cache_batch_idx``) or the
pages of its row (``page_table``), and loads whole key tiles from that row or
page. Where a page holds a whole number of tiles, a paged tile is one contiguous
load after one scalar read of the table. Otherwise (pages shorter than the tile,
or of a size the tile does not divide) the tile is gathered key by key: each key
reads its page from the table and its slot in that page, so any page size runs
with tiles as long as a contiguous cache's. Slots outside a row's keys are never
let into the sums, whatever they hold (NaN included): their logits are masked and
their values zeroed before the product. Tiles whose every key every query sees
(``common.kvcache.full_key_range``: the whole row of a full cache but for its
edges) skip both: on an H200 (2026-11-25, GQA 32:8, Sq = 16) that took 6% off the
time at B32 Sk4k and B64 Sk8k
(docs/reports/2026-11-25-h200-decode-plain-tiles.txt).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...common import epilogue
from ...common import kvcache as kv
from . import decode as td

DTYPES = ("float32", "bfloat16", "float16")


def _block_kv(spec: kv.KvCacheSpec, cfg: td.DecodeConfig) -> int:
  if spec.paged:
    # Gathered tiles may run past the capacity (masked); no longer than needed.
    return max(td.MIN_ROWS, min(cfg.block_kv, 1 << (spec.capacity - 1).bit_length()))
  return min(cfg.block_kv, 1 << (spec.capacity.bit_length() - 1))


def gathered(spec: kv.KvCacheSpec, bk: int) -> bool:
  """Whether a paged tile of ``bk`` keys is gathered key by key (a page does not
  hold a whole number of tiles) rather than loaded from one page."""
  return spec.paged and spec.page_size % bk != 0


def supported(spec: kv.KvCacheSpec) -> str | None:
  """None, or why this kernel cannot run the call (the xla path then does)."""
  if spec.dtype not in DTYPES:
    return f"pallas-triton kvcache: dtype {spec.dtype}"
  if spec.head_dim not in td.HEAD_DIMS or spec.head_dim_v not in td.HEAD_DIMS:
    return (f"pallas-triton kvcache: head dims {spec.head_dim}/{spec.head_dim_v} "
            f"(supported: {td.HEAD_DIMS})")
  if spec.seq_q * spec.group_size > td.MAX_ROWS:
    return (f"pallas-triton kvcache: {spec.seq_q} queries x {spec.group_size} heads"
            f" per key head > {td.MAX_ROWS} rows")
  if not spec.paged and spec.capacity < td.MIN_ROWS:
    return f"pallas-triton kvcache: cache length {spec.capacity} < {td.MIN_ROWS}"
  return None


def default_config(spec: kv.KvCacheSpec) -> td.DecodeConfig:
  """decode.py's tiles where the cache is contiguous, deeper pipelines where it
  is paged, and the call's
  ``num_splits`` (0 = automatic, 1 = none,
  FlashAttention's meaning). H200 sweeps on the benchmark's own caches (2026-11-24,
  bf16, GQA 32:8, D = 128; docs/reports/2026-11-24-h200-kvcache-tiles.txt), GB/s
  at B64 Sk8k / B8 Sk64k / B1 Sk128k (Sq = 1) and B32 Sk4k (Sq = 16):

  - pages whose size 64 does not divide (16, 8, 1, odd sizes): gathered 64-key
    tiles in 6 stages over 4 warps. Second sweep (2026-11-25,
    docs/reports/2026-11-25-h200-kvcache-gathered-tiles.txt), pages of 16:
    4231 / 4331 / 3688 and 3497 at Sq = 16, against 16-key page tiles (8 stages
    over 2 warps, 10 over 4 at Sq = 16) 4279 / 3333 / 3062 and 2395, and the
    contiguous cache 4230 / 4376 / 3706 and 3424 in the same run; pages of 8 and
    1 within 2% of pages of 16. Fewer stages lost (64 keys in 4 stages over 4
    warps: 3319 / 3608 / 3171 / 2956), and 128-key tiles did (3 stages: 4139 /
    4178 / 3461 / 2349);
  - pages of 64: 6 stages 4240 / 4180 / 3693 over 2 warps (3 stages over 4:
    3234 / 3739 / 3342), 3535 over 4 warps at Sq = 16 (3132);
  - pages of 256 at Sq = 16: 64-key tiles in 6 stages 3466 (2 stages: 3112);
  - contiguous at Sq = 16: decode.py's 32-key tiles in 4 stages, once plain
    tiles had dropped the mask, read 0.6-1.8% more than 64-key tiles in 3 at
    B32 Sk4k, B64 Sk8k, B16 Sk8k and B8 Sk16k (2026-11-25,
    docs/reports/2026-11-25-h200-decode-plain-tiles.txt); with the mask they
    had lost 6% at B8 Sk16k. 64-key tiles in 4 or 6 stages lost 1-8%.

  ``block_kv`` is the tile that runs, so :func:`td.fit` sizes the stages for
  it."""
  wide = td.packed_rows(spec) > 16
  if spec.paged and spec.page_size % 64:
    cfg = td.DecodeConfig(block_kv=64, num_stages=6, num_warps=4)
  elif spec.paged and spec.page_size == 64:
    cfg = td.DecodeConfig(block_kv=64, num_stages=6, num_warps=4 if wide else 2)
  elif wide and spec.paged:
    cfg = td.DecodeConfig(block_kv=64, num_stages=6)
  else:
    cfg = td.default_config(spec)
  return dataclasses.replace(cfg, block_kv=_block_kv(spec, cfg),
                             num_splits=spec.num_splits)


def num_splits(spec: kv.KvCacheSpec, cfg: td.DecodeConfig, sms: int) -> int:
  """``cfg.num_splits``, or (0) about two programs per SM, at most one split per
  two tiles of the capacity."""
  return td.splits_for(cfg, spec, -(-spec.capacity // _block_kv(spec, cfg)), sms)


def _kernel(bounds_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, spec, bk,
            rows, splits, precision):
  split = pl.program_id(0)
  lo, hi = bounds_ref[0], bounds_ref[1]
  total, leftpad = bounds_ref[2], bounds_ref[3]
  full_lo, full_hi = bounds_ref[4], bounds_ref[5]

  def tile(j, masked):
    if gathered(spec, bk):
      start = j * bk
      key = start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
      # Keys past the capacity (a tile longer than the row) read its last page
      # and are masked below.
      page = rows_ref[jnp.minimum(key // spec.page_size, spec.max_pages - 1)]
      slot = key % spec.page_size
      k, v = k_ref[page, slot, :], v_ref[page, slot, :]
    elif spec.paged:
      start = j * bk
      page = rows_ref[start // spec.page_size]
      off = start % spec.page_size
      k, v = k_ref[page, pl.ds(off, bk), :], v_ref[page, pl.ds(off, bk), :]
    else:
      # A plain tile lies inside the row's keys, so inside the capacity.
      start = jnp.minimum(j * bk, spec.capacity - bk) if masked else j * bk
      r = rows_ref[0]
      k, v = k_ref[r, pl.ds(start, bk), :], v_ref[r, pl.ds(start, bk), :]
    if not masked:
      return k, v, None
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
    kcol = jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    diag = kv.query_of_row(row, spec, td.direct(spec)) + total - spec.seq_q
    first_new = jnp.maximum(leftpad, j * bk)
    pos = start + col
    ok = (row < spec.seq_q * spec.group_size) & (pos >= first_new) & (pos < total)
    if spec.right is not None:
      ok &= pos <= diag + spec.right
    if spec.left is not None:
      ok &= pos >= diag - spec.left
    # Free slots may hold anything, NaN included: p = 0 there must not meet it.
    kpos = start + kcol
    v = jnp.where((kpos >= first_new) & (kpos < total), v, jnp.zeros_like(v))
    return k, v, ok

  first = lo // bk
  last = jnp.where(hi > lo, (hi + bk - 1) // bk, first)
  per = (last - first + splits - 1) // splits
  j0 = first + split * per
  # Tiles whose keys every query sees: no mask, and no free slot to zero.
  plain = ((full_lo + bk - 1) // bk, full_hi // bk)
  out, lse = td.run_split(td.load_q(q_ref, spec), j0,
                          jnp.minimum(j0 + per, last), tile, plain, spec=spec,
                          rows=rows, precision=precision)
  td.store(o_ref, lse_ref, out, lse, spec)


def attention(prep: kv.Prepared, sinks, spec: kv.KvCacheSpec,
              config: td.DecodeConfig | None, sms: int, interpret: bool = False):
  """``(out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq])`` over the prepared
  (rotated, appended) cache."""
  cfg = config or td.fit(default_config(spec), spec, td.packed_rows(spec))
  if not isinstance(cfg, td.DecodeConfig):
    raise ValueError("config must be a pallas_gpu.triton.decode.DecodeConfig, got "
                     f"{type(cfg).__name__}")
  b, d, dv = spec.batch, spec.head_dim, spec.head_dim_v
  rows, bk = td.packed_rows(spec), _block_kv(spec, cfg)
  splits = num_splits(spec, cfg, sms)
  lo, hi = kv.key_range(prep.total, prep.leftpad, spec)
  full_lo, full_hi = kv.full_key_range(prep.total, prep.leftpad, spec)
  bounds = jnp.stack([lo, hi, prep.total, prep.leftpad, full_lo, full_hi],
                     axis=1).astype(jnp.int32)
  if spec.paged:
    table = jnp.clip(prep.rows, 0, spec.cache_rows - 1).astype(jnp.int32)
    rows_spec = pl.BlockSpec((None, spec.max_pages), lambda s, i, h: (i, 0))
    cache_block = (spec.cache_rows, spec.page_size)
  else:
    table = prep.rows.astype(jnp.int32)[:, None]
    rows_spec = pl.BlockSpec((None, 1), lambda s, i, h: (i, 0))
    cache_block = (spec.cache_rows, spec.capacity)
  q, q_spec = td.q_operand(prep.q, spec, rows)
  precision = jax.lax.Precision.HIGHEST if spec.dtype == "float32" else None
  kernel = functools.partial(_kernel, spec=spec, bk=bk, rows=rows, splits=splits,
                             precision=precision)
  in_specs = [pl.BlockSpec((None, 6), lambda s, i, h: (i, 0)), rows_spec, q_spec,
              pl.BlockSpec(cache_block + (None, d), lambda s, i, h: (0, 0, h, 0)),
              pl.BlockSpec(cache_block + (None, dv), lambda s, i, h: (0, 0, h, 0))]
  o, lse = td.launch(kernel, in_specs,
                     (bounds, table, q, prep.k_cache, prep.v_cache), batch=b,
                     spec=spec, cfg=cfg, splits=splits, rows=rows,
                     interpret=interpret, name="flashjax_pallas_triton_kvcache",
                     out_dtype=prep.q.dtype)
  out, lse = td.combine(o, lse, spec)
  if spec.num_sinks:
    out, lse = epilogue.add_sinks(out, lse, sinks)
  return out.astype(prep.q.dtype), lse
