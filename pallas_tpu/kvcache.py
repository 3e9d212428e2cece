"""Decode kernel over a KV cache: grid (B, Hkv, cache blocks), one block per step.

The block of step ``j`` is a page (paged cache: ``page_size`` positions) or
``block_kv`` positions of the row's contiguous cache. The page table (or the
contiguous rows) and the per-row key ranges are scalar-prefetched, so the k/v
index maps turn them into the block DMAs: step ``j`` of row ``b`` fetches page
``page_table[b, j]``. Steps outside the row's key range keep the previous block
index (Pallas issues no DMA for a repeated block) and ``pl.when`` skips their
compute. All query heads of one key head and all queries form one ``[G * Sq, D]``
tile, so a decode step reads each page once per key head.

The cache stays in its ``[rows, positions, Hkv, D]`` layout (a transpose would
copy the whole cache every call): a block is ``[positions, D]`` of one key head.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import epilogue
from ..common import kvcache as kv
from . import tile
from .config import NUM_LANES

DTYPES = ("float32", "bfloat16", "float16")
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvCacheConfig:
  """Positions per step of a contiguous cache (a paged cache steps by pages)."""

  block_kv: int = 512

  def __post_init__(self):
    if not isinstance(self.block_kv, int) or isinstance(self.block_kv, bool) or (
        self.block_kv < 1):
      raise ValueError(f"block_kv must be a positive int, got {self.block_kv!r}")


def kvcache_supported(spec: kv.KvCacheSpec) -> str | None:
  if spec.dtype not in DTYPES:
    return f"pallas-tpu: dtype {spec.dtype} (supported: {', '.join(DTYPES)})"
  d = max(spec.head_dim, spec.head_dim_v)
  if d > MAX_HEAD_DIM:
    return f"pallas-tpu: head dim {d} > {MAX_HEAD_DIM}"
  return None


def _kernel(table, lo, hi, total, leftpad, q_ref, k_ref, v_ref, o_ref, lse_ref,
            *refs, spec: kv.KvCacheSpec, bk: int, count: bool):
  cnt_ref = refs[0] if count else None
  m_sc, l_sc, acc_sc = refs[1:] if count else refs
  b, j = pl.program_id(0), pl.program_id(2)
  del table  # used by the index maps only

  pl.when(j == 0)(lambda: tile.init_rows(m_sc, l_sc, acc_sc, cnt_ref))

  @pl.when((j >= lo[b]) & (j < hi[b]))
  def _step():
    rows = q_ref.shape[0]
    pos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
    row = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0),
                      spec.seq_q)
    ok = kv.key_allowed(pos, row, total[b], leftpad[b], spec)
    s = tile.matmul_nt(q_ref[...], k_ref[...]) * spec.softmax_scale
    if spec.logits_soft_cap is not None:
      s = spec.logits_soft_cap * jnp.tanh(s / spec.logits_soft_cap)
    s = jnp.where(ok, s, -jnp.inf)
    p, alpha = tile.online_softmax(s, m_sc, l_sc)
    # Free slots (and a partial last block's padding) are never read: whatever
    # they hold must not reach the output through 0 * x.
    col = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    v = v_ref[...]
    v = jnp.where(kv.key_held(col, total[b], leftpad[b]), v, jnp.zeros_like(v))
    acc_sc[...] = alpha * acc_sc[...] + tile.matmul(p.astype(v.dtype), v)
    if cnt_ref is not None:
      cnt_ref[...] += 1

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    out, lse = tile.finish_rows(acc_sc, m_sc, l_sc)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def kvcache_attention(prep: kv.Prepared, sinks, spec: kv.KvCacheSpec,
                      config: KvCacheConfig | None = None, *, interpret=False,
                      count: bool = False):
  """``(out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] fp32)`` over the
  prepared (rotated, appended) cache; with ``count`` also the executed (not
  skipped) steps ``[B, Hkv]``, counted inside the kernel (for tests)."""
  reason = kvcache_supported(spec)
  if reason:
    raise NotImplementedError(reason)
  if not interpret and jax.default_backend() != "tpu":
    raise NotImplementedError("pallas-tpu: needs a TPU, or interpret=True on CPU")
  config = config or KvCacheConfig()
  if not isinstance(config, KvCacheConfig):
    raise ValueError(f"config must be a pallas_tpu.KvCacheConfig, got "
                     f"{type(config).__name__}")
  b, hkv, d, dv = spec.batch, spec.heads_kv, spec.head_dim, spec.head_dim_v
  rows_q = spec.group_size * spec.seq_q
  if spec.paged:
    bk, n_blocks = spec.page_size, spec.max_pages
    # Entries past a row's pages may hold anything; the DMAs must stay in the pool.
    table = jnp.clip(prep.rows, 0, spec.cache_rows - 1).reshape(-1)
  else:
    bk = min(config.block_kv, spec.capacity)
    n_blocks = -(-spec.capacity // bk)
    table = prep.rows
  lo, hi = kv.key_range(prep.total, prep.leftpad, spec)
  lo_blk = jnp.minimum(lo // bk, n_blocks - 1)
  hi_blk = jnp.where(lo < hi, -(-hi // bk), lo_blk)  # empty rows run no step

  def block(bi, j, lo_blk, hi_blk):
    """Step j's block, clamped into the row's range (no new DMA outside it)."""
    return jnp.clip(j, lo_blk[bi], jnp.maximum(hi_blk[bi] - 1, lo_blk[bi]))

  if spec.paged:
    def kv_map(bi, h, j, table, lo, hi, *_):
      return (table[bi * spec.max_pages + block(bi, j, lo, hi)], 0, h, 0)
  else:
    def kv_map(bi, h, j, table, lo, hi, *_):
      return (table[bi], block(bi, j, lo, hi), h, 0)

  q = kv.group_queries(prep.q, spec)  # [B, Hkv, G*Sq, D]: small
  row_map = lambda bi, h, j, *_: (bi, h, 0, 0)
  out_shape = [jax.ShapeDtypeStruct((b, hkv, rows_q, dv), prep.q.dtype),
               jax.ShapeDtypeStruct((b, hkv, rows_q, 1), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, rows_q, dv), row_map),
               pl.BlockSpec((None, None, rows_q, 1), row_map)]
  if count:
    out_shape.append(jax.ShapeDtypeStruct((b, hkv, 1, 1), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, 1, 1), row_map))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5, grid=(b, hkv, n_blocks),
      in_specs=[pl.BlockSpec((None, None, rows_q, d), row_map),
                pl.BlockSpec((None, bk, None, d), kv_map),
                pl.BlockSpec((None, bk, None, dv), kv_map)],
      out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((rows_q, NUM_LANES), jnp.float32),
                      pltpu.VMEM((rows_q, NUM_LANES), jnp.float32),
                      pltpu.VMEM((rows_q, dv), jnp.float32)])
  res = pl.pallas_call(
      functools.partial(_kernel, spec=spec, bk=bk, count=count),
      grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      # Simulates TPU memory spaces and DMA; uninitialised memory reads as NaN.
      interpret=pltpu.InterpretParams() if interpret else False,
      name="flashjax_tpu_kvcache",
  )(table, lo_blk, hi_blk, prep.total, prep.leftpad, q, prep.k_cache, prep.v_cache)
  out, lse = kv.ungroup(res[0], res[1][..., 0], spec)
  if spec.num_sinks:
    sunk, lse = epilogue.add_sinks(out, lse, sinks)
    out = sunk.astype(out.dtype)
  return (out, lse, res[2][..., 0, 0]) if count else (out, lse)
