"""The KV-cache form of the contract (``flash_mha_with_kvcache``): validation, the
rotary embedding, the append of new keys, and the position math every platform and
the reference share.

Batch row ``b`` attends to cache positions ``[leftpad_b, L_b)`` (``L_b =
cache_seqlens[b]``) followed by the ``S_new`` new keys, which are written at
positions ``L_b .. L_b + S_new - 1``. After the append the row's keys are the
positions ``[leftpad_b, T_b)`` with ``T_b = L_b + S_new``, and causal / window bands
are bottom-right aligned on ``T_b``: query ``i`` sees position ``p`` iff
``p - (i + T_b - Sq)`` lies in ``[-left, right]``.

A cache is contiguous, ``[B_cache, S_cache, Hkv, D]`` (row ``cache_batch_idx[b]``
serves query row ``b``), or paged, ``[num_pages, page_size, Hkv, D]`` with
``page_table [B, max_pages]``: position ``t`` of row ``b`` lives in page
``page_table[b, t // page_size]`` at slot ``t % page_size``. Either way a row holds
``capacity`` positions (``S_cache``, or ``max_pages * page_size``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import spec as spec_lib
from .spec import parse_window, shape_of

DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvCacheSpec:
  """Everything about a KV-cache call except the array values."""

  batch: int
  seq_q: int
  heads_q: int
  heads_kv: int
  head_dim: int
  head_dim_v: int
  dtype: str
  softmax_scale: float
  left: int | None = None  # window bounds around the aligned diagonal
  right: int | None = None  # None = unbounded, 0 = causal
  causal: bool = False
  cache_rows: int  # B_cache, or num_pages when paged
  capacity: int  # positions per batch row
  page_size: int | None = None  # None: contiguous cache
  seq_new: int = 0  # new keys appended per row (0: none)
  rotary_dim: int = 0
  rotary_interleaved: bool = True
  logits_soft_cap: float | None = None
  num_sinks: int = 0
  num_splits: int = 1
  return_lse: bool = False

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def group_size(self) -> int:
    return self.heads_q // self.heads_kv

  @property
  def max_pages(self) -> int:
    return self.capacity // self.page_size if self.paged else 0


class KvOperands(NamedTuple):
  """Canonical arrays of a KV-cache call; absent ones are None."""

  q: Any  # [B, Sq, Hq, D]
  k_cache: Any  # [B_cache, S_cache, Hkv, D] or [num_pages, page_size, Hkv, D]
  v_cache: Any  # same, with Dv
  k: Any = None  # [B, S_new, Hkv, D]
  v: Any = None  # [B, S_new, Hkv, Dv]
  cache_seqlens: Any = None  # int32 [B], before the append
  cache_leftpad: Any = None  # int32 [B]
  cache_batch_idx: Any = None  # int32 [B] (contiguous only)
  page_table: Any = None  # int32 [B, max_pages]
  rotary_cos: Any = None  # [S_ro, rotary_dim / 2]
  rotary_sin: Any = None
  sinks: Any = None  # [Hq, n]


def _concrete(x):
  """``x`` as a numpy int array when its values are known, else None (traced
  values raise on conversion; abstract ones convert to an object array)."""
  if x is None:
    return None
  try:
    value = np.asarray(x)
  except jax.errors.JAXTypeError:
    return None
  return value if value.dtype.kind in "iu" else None


def _int_vector(x, name, batch, *, default=None):
  if x is None:
    return default
  if isinstance(x, numbers.Integral) and not isinstance(x, bool):
    return jnp.full((batch,), int(x), jnp.int32)
  shape = shape_of(x, name)
  if shape not in ((batch,), ()) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an int or an int array [B] = [{batch}], got "
                     f"shape {shape} dtype {jnp.dtype(x.dtype).name}")
  return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch,))


def canonicalize(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                 cache_batch_idx=None, cache_leftpad=None, page_table=None,
                 rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                 softmax_scale=None, causal=False, window_size=(-1, -1),
                 logits_soft_cap=None, sinks=None, num_splits=1,
                 return_lse=False) -> tuple[KvOperands, KvCacheSpec]:
  """Validates a KV-cache call; returns ``(KvOperands, KvCacheSpec)``.

  Shapes and dtypes are checked always; the values of the lengths, page table,
  batch indices and rotary positions whenever they are concrete (not traced).
  """
  qs, kcs = shape_of(q, "q"), shape_of(k_cache, "k_cache")
  vcs = shape_of(v_cache, "v_cache")
  for name, s in (("q", qs), ("k_cache", kcs), ("v_cache", vcs)):
    if len(s) != 4 or min(s) < 1:
      raise ValueError(f"{name} must be a non-empty rank-4 array, got shape {s}")
  b, sq, hq, d = qs
  rows, slots, hkv, dk = kcs
  if vcs[:3] != kcs[:3]:
    raise ValueError(f"k_cache and v_cache differ in their first three dims: "
                     f"k_cache {kcs}, v_cache {vcs}")
  if dk != d:
    raise ValueError(f"q and k_cache head dims differ: q {qs}, k_cache {kcs}")
  if hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of the cache's "
                     f"key/value heads ({hkv})")
  dtype = jnp.dtype(q.dtype).name
  if dtype not in DTYPES:
    raise ValueError(f"q dtype must be one of {DTYPES}, got {dtype}")
  for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
    if x is not None and jnp.dtype(x.dtype).name != dtype:
      raise ValueError(f"{name} must have q's dtype {dtype}, got "
                       f"{jnp.dtype(x.dtype).name}")

  if page_table is not None:
    if cache_batch_idx is not None:
      raise ValueError("cache_batch_idx selects rows of a contiguous cache; with a "
                       "page_table the table already maps each batch row to its pages")
    pts = shape_of(page_table, "page_table")
    if len(pts) != 2 or pts[0] != b or not jnp.issubdtype(page_table.dtype,
                                                           jnp.integer):
      raise ValueError(f"page_table must be an int array [B, max_pages] with B = {b},"
                       f" got shape {pts} dtype {jnp.dtype(page_table.dtype).name}")
    page_table = jnp.asarray(page_table, jnp.int32)
    page_size, capacity = slots, pts[1] * slots
  else:
    page_size, capacity = None, slots
    if cache_batch_idx is None and rows != b:
      raise ValueError(f"k_cache has {rows} rows but q has batch {b}: pass "
                       "cache_batch_idx to pick the rows")

  seq_new = 0
  if (k is None) != (v is None):
    raise ValueError("k and v (the new keys and values) must be given together")
  if k is not None:
    ks, vs = shape_of(k, "k"), shape_of(v, "v")
    if len(ks) != 4 or ks[0] != b or ks[2:] != (hkv, d):
      raise ValueError(f"k must be [B, S_new, Hkv, D] = [{b}, S_new, {hkv}, {d}], "
                       f"got {ks}")
    if vs != ks[:3] + (vcs[3],):
      raise ValueError(f"v must be [B, S_new, Hkv, Dv] = {list(ks[:3] + (vcs[3],))}, "
                       f"got {vs}")
    seq_new = ks[1]

  if cache_seqlens is None:
    if page_table is not None or seq_new:
      raise ValueError("cache_seqlens is required with a page_table or new keys "
                       "(it says where the valid cache ends)")
    cache_seqlens = capacity
  seqlens = _int_vector(cache_seqlens, "cache_seqlens", b)
  leftpad = _int_vector(cache_leftpad, "cache_leftpad", b,
                        default=jnp.zeros((b,), jnp.int32))
  batch_idx = _int_vector(cache_batch_idx, "cache_batch_idx", b)

  if softmax_scale is None:
    softmax_scale = 1.0 / math.sqrt(d)
  if (not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)
      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
    raise ValueError("softmax_scale must be a finite positive number, got "
                     f"{softmax_scale!r}")
  if window_size is None:
    window_size = (-1, -1)
  left, right = parse_window(window_size, causal)

  rotary_dim = 0
  if (rotary_cos is None) != (rotary_sin is None):
    raise ValueError("rotary_cos and rotary_sin must be given together")
  if rotary_cos is not None:
    if k is None:
      raise ValueError("rotary embedding needs the new keys k (the cache holds "
                       "keys that are already rotated)")
    cs, ss = shape_of(rotary_cos, "rotary_cos"), shape_of(rotary_sin, "rotary_sin")
    if len(cs) != 2 or cs != ss or 2 * cs[1] > d:
      raise ValueError(f"rotary_cos and rotary_sin must both be [S_ro, rotary_dim/2]"
                       f" with rotary_dim <= D = {d}, got {cs} and {ss}")
    rotary_dim = 2 * cs[1]
  if not isinstance(rotary_interleaved, bool):
    raise ValueError(f"rotary_interleaved must be a bool, got {rotary_interleaved!r}")

  logits_soft_cap = spec_lib.soft_cap(logits_soft_cap)
  sinks, num_sinks = spec_lib.sinks_per_head(sinks, hq)
  if not isinstance(num_splits, numbers.Integral) or isinstance(
      num_splits, bool) or num_splits < 0:
    raise ValueError(f"num_splits must be an int >= 0 (0 = automatic), got "
                     f"{num_splits!r}")
  if not isinstance(return_lse, bool):
    raise ValueError(f"return_softmax_lse must be a bool, got {return_lse!r}")

  spec = KvCacheSpec(
      batch=b, seq_q=sq, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=vcs[3],
      dtype=dtype, softmax_scale=float(softmax_scale), left=left, right=right,
      causal=bool(causal), cache_rows=rows, capacity=capacity, page_size=page_size,
      seq_new=seq_new, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
      logits_soft_cap=logits_soft_cap, num_sinks=num_sinks,
      num_splits=int(num_splits), return_lse=return_lse)
  ops = KvOperands(q, k_cache, v_cache, k, v, seqlens, leftpad, batch_idx, page_table,
                   rotary_cos, rotary_sin, sinks)
  _check_values(ops, spec)
  return ops, spec


def _check_values(ops: KvOperands, spec: KvCacheSpec):
  """Range checks of the index arrays whose values are known at trace time."""
  lens, pad = _concrete(ops.cache_seqlens), _concrete(ops.cache_leftpad)
  if lens is not None:
    if lens.min() < 0 or lens.max() + spec.seq_new > spec.capacity:
      raise ValueError(
          f"cache_seqlens + S_new must lie in [0, {spec.capacity}] (the cache holds "
          f"{spec.capacity} positions per row), got cache_seqlens {lens.tolist()} "
          f"with S_new = {spec.seq_new}")
  if pad is not None:
    hi = lens if lens is not None else spec.capacity
    if pad.min() < 0 or np.any(pad > hi):
      raise ValueError(f"cache_leftpad must lie in [0, cache_seqlens], got "
                       f"{pad.tolist()}")
  idx = _concrete(ops.cache_batch_idx)
  if idx is not None and (idx.min() < 0 or idx.max() >= spec.cache_rows):
    raise ValueError(f"cache_batch_idx must lie in [0, {spec.cache_rows}) (rows of "
                     f"k_cache), got {idx.tolist()}")
  table = _concrete(ops.page_table)
  if table is not None and lens is not None:
    used = -(-(lens + spec.seq_new) // spec.page_size)  # pages holding valid keys
    for b, n in enumerate(used):
      pages = table[b, :n]
      if pages.size and (pages.min() < 0 or pages.max() >= spec.cache_rows):
        raise ValueError(f"page_table row {b} points past the pool of "
                         f"{spec.cache_rows} pages: {pages.tolist()}")
  s_ro = None if ops.rotary_cos is None else ops.rotary_cos.shape[0]
  if s_ro is not None and lens is not None:
    pad_v = pad if pad is not None else 0
    rows = max(spec.seq_new, spec.seq_q if rotates_per_query(spec) else 1)
    last = int(np.max(lens - pad_v)) + rows - 1
    if last >= s_ro:
      raise ValueError(f"rotary_cos/rotary_sin have {s_ro} positions but position "
                       f"{last} is needed (cache_seqlens - cache_leftpad + new rows)")


# -- rotary embedding ------------------------------------------------------------


def rotates_per_query(spec: KvCacheSpec) -> bool:
  """Queries take positions ``L - leftpad + i`` when causal or windowed, else all
  sit at ``L - leftpad`` (FlashAttention's rule)."""
  return spec.causal or spec.left is not None or spec.right is not None


def rotate(x, cos, sin, positions, interleaved: bool):
  """Rotary embedding of the first ``2 * cos.shape[1]`` dims of ``x [B, S, H, D]``
  at integer ``positions [B, S]``; fp32 math, result in x's dtype.

  ``interleaved`` rotates the pairs (0, 1), (2, 3), ...; otherwise the two halves
  of the rotary dims (GPT-NeoX): dim ``j`` with dim ``j + rotary_dim / 2``.
  """
  half = cos.shape[1]
  c = jnp.take(cos.astype(jnp.float32), positions, axis=0)[:, :, None, :]
  s = jnp.take(sin.astype(jnp.float32), positions, axis=0)[:, :, None, :]
  xr = x[..., :2 * half].astype(jnp.float32)
  if interleaved:
    x1, x2 = xr[..., 0::2], xr[..., 1::2]
    y = jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(xr.shape)
  else:
    x1, x2 = xr[..., :half], xr[..., half:]
    y = jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
  return jnp.concatenate([y.astype(x.dtype), x[..., 2 * half:]], axis=-1)


def rotary_positions(ops: KvOperands, spec: KvCacheSpec):
  """``(q_positions [B, Sq], k_positions [B, S_new])`` into the rotary tables."""
  base = (ops.cache_seqlens - ops.cache_leftpad)[:, None]
  qi = jnp.arange(spec.seq_q, dtype=jnp.int32)[None]
  q_pos = base + qi if rotates_per_query(spec) else jnp.broadcast_to(
      base, (spec.batch, spec.seq_q))
  return q_pos, base + jnp.arange(spec.seq_new, dtype=jnp.int32)[None]


# -- the append ----------------------------------------------------------------------


def append(cache, new, ops: KvOperands, spec: KvCacheSpec):
  """``cache`` with ``new [B, S_new, Hkv, X]`` written at positions
  ``L_b .. L_b + S_new - 1`` of each batch row (a functional update: in place only
  when the caller donates the buffer)."""
  pos = ops.cache_seqlens[:, None] + jnp.arange(spec.seq_new, dtype=jnp.int32)[None]
  if spec.paged:
    row = jnp.take_along_axis(ops.page_table, pos // spec.page_size, axis=1)
    slot = pos % spec.page_size
  else:
    row = (jnp.arange(spec.batch, dtype=jnp.int32) if ops.cache_batch_idx is None
           else ops.cache_batch_idx)[:, None]
    row, slot = jnp.broadcast_to(row, pos.shape), pos
  return cache.at[row, slot].set(new.astype(cache.dtype), mode="drop")


class Prepared(NamedTuple):
  """What an attention kernel over the cache needs after rotary and the append."""

  q: Any  # [B, Sq, Hq, D], rotated
  k_cache: Any  # updated
  v_cache: Any
  total: Any  # int32 [B]: T_b = L_b + S_new, the end of the valid keys
  leftpad: Any  # int32 [B]
  rows: Any  # int32 [B] cache rows (contiguous) or [B, max_pages] page table


def prepare(ops: KvOperands, spec: KvCacheSpec) -> Prepared:
  q, k_new = ops.q, ops.k
  if spec.rotary_dim:
    q_pos, k_pos = rotary_positions(ops, spec)
    q = rotate(q, ops.rotary_cos, ops.rotary_sin, q_pos, spec.rotary_interleaved)
    k_new = rotate(k_new, ops.rotary_cos, ops.rotary_sin, k_pos,
                   spec.rotary_interleaved)
  k_cache, v_cache = ops.k_cache, ops.v_cache
  if spec.seq_new:
    k_cache = append(k_cache, k_new, ops, spec)
    v_cache = append(v_cache, ops.v, ops, spec)
  if spec.paged:
    rows = ops.page_table
  else:
    rows = (jnp.arange(spec.batch, dtype=jnp.int32) if ops.cache_batch_idx is None
            else ops.cache_batch_idx)
  return Prepared(q, k_cache, v_cache, ops.cache_seqlens + spec.seq_new,
                  ops.cache_leftpad, rows)


# -- what attends to what ------------------------------------------------------------


def key_held(pos, total, leftpad):
  """Whether cache position ``pos`` holds one of the row's keys."""
  return (pos >= leftpad) & (pos < total)


def key_allowed(pos, row, total, leftpad, spec: KvCacheSpec):
  """Whether query ``row`` sees cache position ``pos`` (broadcastable int arrays;
  ``total`` and ``leftpad`` per batch row, broadcast by the caller)."""
  ok = key_held(pos, total, leftpad)
  d = pos - (row + total - spec.seq_q)
  if spec.left is not None:
    ok = ok & (d >= -spec.left)
  if spec.right is not None:
    ok = ok & (d <= spec.right)
  return ok


def key_range(total, leftpad, spec: KvCacheSpec):
  """Per batch row, the half-open position range ``[lo, hi)`` any query can see
  (``lo >= hi`` when none); kernels visit only the blocks that meet it."""
  lo, hi = leftpad, total
  if spec.left is not None:
    lo = jnp.maximum(lo, total - spec.seq_q - spec.left)
  if spec.right is not None:
    hi = jnp.minimum(hi, total - 1 + spec.right + 1)
  return lo, jnp.maximum(lo, hi)


def full_key_range(total, leftpad, spec: KvCacheSpec):
  """Per batch row, the half-open position range ``[lo, hi)`` that every query
  sees (``lo >= hi`` when none): key tiles inside it need no mask."""
  lo, hi = leftpad, total
  if spec.left is not None:
    lo = jnp.maximum(lo, total - 1 - spec.left)
  if spec.right is not None:
    hi = jnp.minimum(hi, total - spec.seq_q + spec.right + 1)
  return lo, jnp.maximum(lo, hi)


def group_queries(q, spec):
  """``[B, Sq, Hq, D]`` -> ``[B, Hkv, G * Sq, D]``: the queries of one key head
  as one matrix, row ``g * Sq + i`` (query ``i`` of head ``h * G + g``). ``spec``:
  a :class:`KvCacheSpec` or an ``AttentionSpec`` (the decode kernels')."""
  b, sq, hq, d = q.shape
  x = q.reshape(b, sq, spec.heads_kv, spec.group_size, d)
  return jnp.transpose(x, (0, 2, 3, 1, 4)).reshape(b, spec.heads_kv, -1, d)


def query_of_row(row, spec, query_major: bool = False):
  """The query index (``0 .. Sq-1``) of row ``row`` of one kv head's q matrix:
  :func:`group_queries`' order (row ``g * Sq + i``), or ``query_major`` (row
  ``i * G + g``: a ``[Sq, G, D]`` block of ``[B, Sq, Hq, D]`` with its first two
  axes merged, which the GPU decode kernels read without a transpose)."""
  return row // spec.group_size if query_major else row % spec.seq_q


def ungroup(out, lse, spec):
  """Inverse of :func:`group_queries` for ``out [B, Hkv, G*Sq, Dv]`` and
  ``lse [B, Hkv, G*Sq]`` -> ``[B, Sq, Hq, Dv]``, ``[B, Hq, Sq]``."""
  b, sq = spec.batch, spec.seq_q
  out = out.reshape(b, spec.heads_kv, spec.group_size, sq, -1)
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, sq, spec.heads_q, -1)
  return out, lse.reshape(b, spec.heads_q, sq)
