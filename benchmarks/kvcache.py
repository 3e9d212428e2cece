"""KV-cache shapes (``Shape.page_size`` not None): ``flash_mha_with_kvcache`` of
flashjax and of the peers side by side, over full caches, contiguous or paged.

For a KV-cache shape the CLI's implementations become:

* ``flashjax[kvcache]``: ``flashjax.flash_mha_with_kvcache`` with the automatic
  platform and ``num_splits=0`` (automatic), when any flashjax implementation
  is asked for; beside it ``xla[kvcache]`` (``platform="xla"``, the universal
  fallback) on backends whose automatic choice is a kernel, when ``xla`` is asked
  for;
* ``flash-attn3-jax[kvcache]`` (where that peer imports): its
  ``flash_mha_with_kvcache`` with ``num_splits`` from :func:`fa3_num_splits`
  (its wrapper refuses 0, FlashAttention's automatic choice).

Every row of a batch holds ``seq_k`` positions, all valid (``cache_seqlens`` =
capacity). A paged cache is a pool of ``batch * seq_k / page_size`` pages that
a random permutation ``page_table`` hands out, so a row's pages lie scattered
over the pool as in a serving system. Each variant is first checked against the
reference on a smaller cache of the same kind: its output against
``reference.attention`` on the keys gathered back through the page table. Only
the forward is timed (a KV-cache call has no backward); the other directions
are reported as skipped. K+V GB/s counts the bytes of the cache's keys and
values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashjax.common import reference, tolerances
from flashjax.common.shapes import Shape
from flashjax.common.timer import time_interleaved_ms

from . import impls, timing

SKIPPED = "skipped: forward only (a KV-cache call has no backward)"
# Rows of flashjax's own entry: a wrong one fails the CLI run.
FLASHJAX_ROWS = ("flashjax[kvcache]", "xla[kvcache]")


class Cache(NamedTuple):
  k: Any  # [B, Sk, Hkv, D] contiguous, or the pool [num_pages, page_size, Hkv, D]
  v: Any  # same, with Dv
  seqlens: Any  # int32 [B]: every row full
  page_table: Any = None  # int32 [B, Sk / page_size], or None (contiguous)


def page_table(shape: Shape, seed: int = 0) -> np.ndarray | None:
  """``[B, Sk / page_size]`` int32: a random permutation of the pool's pages;
  None for a contiguous cache."""
  if not shape.page_size:
    return None
  per_row = shape.seq_k // shape.page_size
  order = np.random.default_rng(seed).permutation(shape.batch * per_row)
  return order.reshape(shape.batch, per_row).astype(np.int32)


def make_cache(shape: Shape, k, v) -> Cache:
  """The cache holding the contiguous ``k, v [B, Sk, Hkv, D]``: the arrays
  themselves, or pools whose page ``page_table[b, j]`` holds positions
  ``j * page_size ..`` of row b."""
  seqlens = jnp.full((shape.batch,), shape.seq_k, jnp.int32)
  table = page_table(shape)
  if table is None:
    return Cache(k, v, seqlens)
  # Page n of the pool is page where[n] of the rows laid end to end.
  where = jnp.asarray(np.argsort(table.ravel()))
  pool = lambda x: x.reshape(-1, shape.page_size, *x.shape[2:])[where]
  return Cache(pool(k), pool(v), seqlens, jnp.asarray(table))


def gather(cache: Cache):
  """The cache's keys and values as contiguous ``[B, Sk, Hkv, D]`` rows."""
  if cache.page_table is None:
    return cache.k, cache.v
  b = cache.page_table.shape[0]
  rows = lambda pool: pool[cache.page_table].reshape(b, -1, *pool.shape[2:])
  return rows(cache.k), rows(cache.v)


def check_shape(shape: Shape) -> Shape:
  """A smaller cache of the same kind for the reference check: at most 2 rows,
  2 key heads (their query heads with them), 16 queries, and about 1024
  positions (whole pages)."""
  kv_heads = min(shape.heads_kv, 2)
  seq_k = min(shape.seq_k, 1024)
  if shape.page_size:
    seq_k = max(shape.page_size, seq_k - seq_k % shape.page_size)
  return dataclasses.replace(
      shape, batch=min(shape.batch, 2), seq_q=min(shape.seq_q, 16), seq_k=seq_k,
      heads_q=shape.heads_q // shape.heads_kv * kv_heads, heads_kv=kv_heads)


def check(fn, shape: Shape, dtype) -> str:
  """Runs ``fn(q, cache, causal)`` on the cache of ``shape`` (pass
  :func:`check_shape`) against the reference on the gathered keys; "ok" or why
  the variant is wrong."""
  q, k, v, _ = timing.random_inputs(shape, dtype, seed=1)
  cache = make_cache(shape, k, v)
  try:
    out = np.asarray(jax.jit(lambda q, c: fn(q, c, shape.causal))(q, cache),
                     np.float32)
  except Exception as e:
    return timing.error_status(e)
  keys, values = gather(cache)
  ref = np.asarray(reference.attention(q, keys, values, causal=shape.causal))
  err = tolerances.rel_l2(out, ref)
  if not np.isfinite(out).all() or err > 2 * tolerances.forward(dtype).rel_l2:
    return f"WRONG (rel. L2 error {err:.2e} on a small cache)"
  return "ok"


def fa3_num_splits(shape: Shape, sms: int) -> int:
  """flash-attn3-jax's ``num_splits``: enough splits of the keys for one program
  per SM over the batch's key heads, a power of two, at most 16 (4 at B8, 16 at
  B1 for GQA 32:8). It picks the best of 1, 4 and 16 splits measured on an H200
  (2026-11-24, docs/reports/2026-11-24-h200-kvcache.txt, contiguous): at B8 Sk64k
  4 splits read 4011 GB/s (16: 3981, 1: 2697), at B1 Sk128k 16 splits 3278 (4:
  1242, 1: 348); at B >= 32 the count made no difference."""
  want = -(-sms // (shape.batch * shape.heads_kv))
  return min(16, 1 << (want - 1).bit_length())


def _flashjax(platform=None):
  import flashjax

  def fn(q, cache: Cache, causal):
    return flashjax.flash_mha_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=cache.seqlens,
        page_table=cache.page_table, is_causal=causal, num_splits=0,
        platform=platform)
  return fn


def _fa3(shape: Shape):
  import flash_attn3_jax

  from flashjax.common import hardware
  splits = fa3_num_splits(shape, hardware.num_sms())

  def fn(q, cache: Cache, causal):
    return flash_attn3_jax.flash_mha_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=cache.seqlens,
        page_table=cache.page_table, is_causal=causal, num_splits=splits)
  return fn


def variants(fns: dict) -> dict:
  """``name -> build(shape) -> fn(q, cache, causal)`` for the CLI's built
  implementations ``fns`` (see the module docstring)."""
  out = {}
  if any(getattr(impls.IMPLS.get(n), "kind", None) == "flashjax" for n in fns):
    out["flashjax[kvcache]"] = lambda s: _flashjax()
    if "xla" in fns and jax.default_backend() != "cpu":
      out["xla[kvcache]"] = lambda s: _flashjax("xla")
  if "flash-attn3-jax" in fns:
    out["flash-attn3-jax[kvcache]"] = _fa3
  return out


def run_shape(fns: dict, shape: Shape, dtype, directions, *, iters, repeats):
  """Rows of the KV-cache variants of the CLI's implementations ``fns``."""
  return run_variants(variants(fns), shape, dtype, directions, iters=iters,
                      repeats=repeats)


def run_variants(builders: dict, shape: Shape, dtype, directions, *, iters,
                 repeats):
  """Rows for every (variant, direction) of one KV-cache shape, variants in
  ``builders`` order: each checked, then the forwards timed in interleaved
  rounds (``timer.time_interleaved_ms``) on one cache."""
  q, k, v, _ = timing.random_inputs(shape, dtype)
  cache = make_cache(shape, k, v)
  del k, v  # a paged cache is a copy: let the contiguous arrays go
  small = check_shape(shape)
  status, calls = {}, {}
  for name, build in builders.items():
    try:
      status[name] = check(build(small), small, dtype)
      fn = build(shape)
    except Exception as e:  # a variant whose entry does not import
      status[name] = timing.error_status(e)
    if status[name] == "ok" and "fwd" in directions:
      fwd = jax.jit(lambda q, c, fn=fn: fn(q, c, shape.causal))
      calls[name] = (fwd, (q, cache))
  times = time_interleaved_ms(calls, iters=iters, repeats=repeats) if calls else {}
  kv_bytes = cache.k.nbytes + cache.v.nbytes
  peak = timing.allocator_peak_mib()
  rows = []
  for name in builders:
    base = dict(impl=name, shape=shape.name, seq=shape.seq_q, causal=shape.causal)
    for d in directions:
      ms = times.get(name)
      if d != "fwd":
        rows.append(timing.Row(**base, direction=d, status=SKIPPED))
      elif status[name] != "ok":
        rows.append(timing.Row(**base, direction=d, status=status[name]))
      elif isinstance(ms, Exception):
        rows.append(timing.Row(**base, direction=d, status=timing.error_status(ms)))
      else:
        rows.append(timing.Row(
            **base, direction=d, ms=ms,
            tflops=timing.shape_flops(shape, d) / (ms * 1e-3) / 1e12 if ms > 0 else None,
            gbs=kv_bytes / (ms * 1e-3) / 1e9 if ms > 0 else None,
            compiled_mib=timing.compiled_mib(calls[name][0], (q, cache)),
            alloc_peak_mib=peak))
  return rows
