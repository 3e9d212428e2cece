"""Attention over a KV cache in plain JAX: one online-softmax loop over key blocks,
each step gathering one block of the cache (``block_kv`` positions: a slice of a
contiguous row, or the pages that hold them), so memory stays O(block) beyond the
cache itself whatever the cache length.

The loop runs only over the blocks some batch row can see (bounds from the traced
lengths, so it is jit-safe); rows mask the positions outside their own range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import epilogue
from ..common import kvcache as kv
from .config import XlaConfig, default_config

_HIGHEST = jax.lax.Precision.HIGHEST


def block_size(spec: kv.KvCacheSpec, config: XlaConfig) -> int:
  """Positions per step: ``block_kv`` (at most the capacity), rounded to whole
  pages for a paged cache (one page when pages are larger)."""
  if spec.paged:
    return max(1, config.fwd.block_kv // spec.page_size) * spec.page_size
  return min(config.fwd.block_kv, spec.capacity)


def attention(prep: kv.Prepared, sinks, spec: kv.KvCacheSpec,
              config: XlaConfig | None = None):
  """``(out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq] fp32)`` over the
  prepared (rotated, appended) cache."""
  config = config or default_config(spec)
  if not isinstance(config, XlaConfig):
    raise ValueError(f"config must be an XlaConfig, got {type(config).__name__}")
  acc = jnp.float64 if spec.dtype == "float64" else jnp.float32
  bk = block_size(spec, config)
  b, hkv, rows_q = spec.batch, spec.heads_kv, spec.group_size * spec.seq_q
  q = kv.group_queries(prep.q, spec).astype(acc)  # [B, Hkv, R, D]
  row = (jnp.arange(rows_q, dtype=jnp.int32) % spec.seq_q)[None, :, None]
  total, leftpad = prep.total[:, None, None], prep.leftpad[:, None, None]
  lo, hi = kv.key_range(prep.total, prep.leftpad, spec)
  nonempty = lo < hi
  first = jnp.min(jnp.where(nonempty, lo, spec.capacity)) // bk
  last = -(-jnp.max(jnp.where(nonempty, hi, 0)) // bk)

  if spec.paged:
    per = bk // spec.page_size
    n_blocks = -(-spec.max_pages // per)
    # Whole blocks of table entries; entries past a row's pages may hold anything.
    table = jnp.clip(jnp.pad(prep.rows, ((0, 0), (0, n_blocks * per - spec.max_pages))),
                     0, spec.cache_rows - 1)

    def gather(j):
      pages = jax.lax.dynamic_slice_in_dim(table, j * per, per, axis=1)  # [B, per]
      take = lambda c: c[pages].reshape((b, bk) + c.shape[2:])
      pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
      return take(prep.k_cache), take(prep.v_cache), pos, pos
  else:
    def gather(j):
      # The last block is shifted back to end at the capacity; positions it
      # shares with the block before are masked out (``fresh``).
      start = jnp.minimum(j * bk, spec.capacity - bk)
      pos = start + jnp.arange(bk, dtype=jnp.int32)
      take = lambda c: c[prep.rows[:, None], pos[None, :]]
      return take(prep.k_cache), take(prep.v_cache), pos, jnp.maximum(pos, j * bk)

  def step(j, carry):
    m, l, o = carry
    k, v, pos, fresh = gather(j)
    s = jnp.einsum("bhrd,bkhd->bhrk", q, k.astype(acc), precision=_HIGHEST)
    s = s * spec.softmax_scale
    if spec.logits_soft_cap is not None:
      s = spec.logits_soft_cap * jnp.tanh(s / spec.logits_soft_cap)
    ok = kv.key_allowed(pos[None, None, :], row, total, leftpad, spec) & (
        pos == fresh)[None, None, :]
    s = jnp.where(ok[:, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    # A row with nothing allowed so far keeps m = -inf; shift by 0 instead.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    # Positions outside a row's keys are never read: whatever a free slot holds
    # (even NaN) must not reach the output through 0 * x.
    held = kv.key_held(pos[None, :], prep.total[:, None], prep.leftpad[:, None]) & (
        pos == fresh)[None, :]
    v = jnp.where(held[:, :, None, None], v.astype(acc), 0.0)
    pv = jnp.einsum("bhrk,bkhd->bhrd", p, v, precision=_HIGHEST)
    return m_new, l * alpha + p.sum(-1), o * alpha[..., None] + pv

  init = (jnp.full((b, hkv, rows_q), -jnp.inf, acc), jnp.zeros((b, hkv, rows_q), acc),
          jnp.zeros((b, hkv, rows_q, spec.head_dim_v), acc))
  m, l, o = jax.lax.fori_loop(first, last, step, init)
  empty = l == 0
  out = o / jnp.where(empty, 1.0, l)[..., None]
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  out, lse = kv.ungroup(out, lse, spec)
  if spec.num_sinks:
    out, lse = epilogue.add_sinks(out, lse, sinks)
  return out.astype(prep.q.dtype), lse
