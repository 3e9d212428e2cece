"""Block layout and per-block math shared by the forward and backward loops."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..common import dropout as dropout_lib
from ..common.blocking import BlockGrid, pad_axis
from ..common.mask import band_allowed
from ..common.spec import AttentionSpec, Operands
from .config import XlaConfig


@dataclasses.dataclass(frozen=True)
class Layout(BlockGrid):
  """Static block geometry of one call."""

  spec: AttentionSpec = None
  compute_dtype: Any = None  # matmul operands
  acc_dtype: Any = None  # accumulation, softmax statistics, bias
  precision: Any = None

  def partial_blocks(self) -> np.ndarray:
    """``[nq, nk]`` bool: True where the band or the key tail cuts the block, so
    its elements need the positional mask; interior blocks skip it."""
    out = np.zeros((self.num_q_blocks, self.num_kv_blocks), bool)
    band = self.spec.band
    for i in range(self.num_q_blocks):
      r0, r1 = i * self.block_q, min((i + 1) * self.block_q, self.spec.seq_q) - 1
      hi_first = band.kv_bounds(r0, r0 + 1)[1]
      lo_last = band.kv_bounds(r1, r1 + 1)[0]
      for j in range(self.num_kv_blocks):
        c0, c1 = j * self.block_kv, (j + 1) * self.block_kv
        out[i, j] = c1 > self.spec.seq_k or c0 < lo_last or c1 > hi_first
    return out


  def split_ranges(self, over_kv: bool) -> tuple[np.ndarray, ...]:
    """Per outer block, ``(lo, a, b, hi)``: the blocks ``[lo, hi)`` it reaches,
    of which ``[a, b)`` need no positional mask and the rest do."""
    partial = self.partial_blocks()
    lo, hi = self.kv_block_ranges() if over_kv else self.q_block_ranges()
    if not over_kv:
      partial = partial.T
    a, b = hi.copy(), hi.copy()
    for o in range(len(lo)):
      inner = np.flatnonzero(~partial[o, lo[o]:hi[o]]) + lo[o]
      if inner.size:
        a[o], b[o] = inner[0], inner[-1] + 1
        # Interior blocks form one run (the band is convex, the tail is last).
        assert not partial[o, a[o]:b[o]].any(), (o, partial[o])
    return lo, a, b, hi


def make_layout(spec: AttentionSpec, config: XlaConfig) -> Layout:
  if config.compute_dtype is not None:
    dtype = jnp.dtype(config.compute_dtype)
  elif spec.dtype == "float64":
    dtype = jnp.dtype(jnp.float64)
  else:
    # bf16/fp16 matmuls are emulated on CPU: upcasting once is faster and exact.
    dtype = jnp.dtype(jnp.float32)
  # Exact fp32 products (no TF32/bf16 passes on accelerators).
  precision = jax.lax.Precision.HIGHEST if dtype.itemsize >= 4 else None
  acc = jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)
  return Layout(band=spec.band, block_q=min(config.block_q, spec.seq_q),
                block_kv=min(config.block_kv, spec.seq_k), spec=spec,
                compute_dtype=dtype, acc_dtype=acc, precision=precision)


class Prepared(NamedTuple):
  """Operands in the loops' layout: head-major, grouped by kv head, padded."""

  q: Any  # [B, Hkv, G, Sqp, D]
  k: Any  # [B, Hkv, Skp, D]
  v: Any  # [B, Hkv, Skp, Dv]
  bias: Any  # [Bb, Hkv|1, G|1, Sqp|1, Skp|1] or None
  mask: Any  # same shape rule, bool, or None
  q_ids: Any  # [B, Sqp] or None
  kv_ids: Any  # [B, Skp] or None
  seed: Any


def to_q_layout(x, lay: Layout):
  """[B, Sq, Hq, X] -> [B, Hkv, G, Sqp, X]: blocks along S are contiguous and each
  kv head's query group shares one batched matmul (no K/V repetition)."""
  s = lay.spec
  x = x.reshape(s.batch, s.seq_q, s.heads_kv, s.group_size, x.shape[-1])
  return pad_axis(jnp.transpose(x, (0, 2, 3, 1, 4)), 3, lay.seq_q_padded)


def from_q_layout(x, lay: Layout):
  s = lay.spec
  x = jnp.transpose(x[:, :, :, :s.seq_q], (0, 3, 1, 2, 4))
  return x.reshape(s.batch, s.seq_q, s.heads_q, x.shape[-1])


def to_kv_layout(x, lay: Layout):
  return pad_axis(jnp.transpose(x, (0, 2, 1, 3)), 2, lay.seq_k_padded)


def from_kv_layout(x, lay: Layout):
  return jnp.transpose(x[:, :, :lay.spec.seq_k], (0, 2, 1, 3))


def _to_grouped(x, lay: Layout, value=0):
  """Rank-4 broadcastable [Bb, Hb, Sqb, Skb] -> [Bb, Hkv|1, G|1, Sqp|1, Skp|1]."""
  s = lay.spec
  bb, hb, sqb, skb = x.shape
  x = x.reshape(bb, s.heads_kv, s.group_size, sqb, skb) if hb > 1 else x.reshape(
      bb, 1, 1, sqb, skb)
  if sqb > 1:
    x = pad_axis(x, 3, lay.seq_q_padded, value)
  if skb > 1:
    x = pad_axis(x, 4, lay.seq_k_padded, value)
  return x


def from_grouped(x, lay: Layout, shape4):
  """Inverse of the bias layout, for dbias."""
  bb, hb, sqb, skb = shape4
  x = x[..., :sqb if sqb > 1 else 1, :skb if skb > 1 else 1]
  return x.reshape(shape4)


def prepare(ops: Operands, lay: Layout) -> Prepared:
  dt = lay.compute_dtype
  q_ids = kv_ids = None
  if ops.q_segment_ids is not None:
    q_ids = pad_axis(ops.q_segment_ids, 1, lay.seq_q_padded)
    kv_ids = pad_axis(ops.kv_segment_ids, 1, lay.seq_k_padded)
  return Prepared(
      q=to_q_layout(ops.q.astype(dt), lay),
      k=to_kv_layout(ops.k.astype(dt), lay),
      v=to_kv_layout(ops.v.astype(dt), lay),
      bias=None if ops.bias is None else _to_grouped(ops.bias.astype(lay.acc_dtype),
                                                     lay),
      mask=None if ops.mask is None else _to_grouped(ops.mask, lay, False),
      q_ids=q_ids, kv_ids=kv_ids, seed=ops.dropout_seed)


def slice_q(x, lay: Layout, i, axis=3):
  return jax.lax.dynamic_slice_in_dim(x, i * lay.block_q, lay.block_q, axis)


def slice_kv(x, lay: Layout, j, axis=2):
  return jax.lax.dynamic_slice_in_dim(x, j * lay.block_kv, lay.block_kv, axis)


def slice_grouped(x, lay: Layout, i, j):
  """The (i, j) block of a bias/mask in grouped layout (size-1 dims stay 1)."""
  if x.shape[3] > 1:
    x = slice_q(x, lay, i, axis=3)
  if x.shape[4] > 1:
    x = slice_kv(x, lay, j, axis=4)
  return x


def logits(prep: Prepared, lay: Layout, q_blk, k_blk, i, j):
  """Scaled, biased, soft-capped ``[B, Hkv, G, bq, bk]``; also ``tanh`` of the
  capped logits (for the backward's chain rule) or None."""
  s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, precision=lay.precision,
                 preferred_element_type=lay.acc_dtype) * lay.spec.softmax_scale
  if prep.bias is not None:
    s = s + slice_grouped(prep.bias, lay, i, j)
  t = None
  cap = lay.spec.logits_soft_cap
  if cap is not None:
    t = jnp.tanh(s / cap)
    s = cap * t
  return s, t


def allowed(prep: Prepared, lay: Layout, i, j, positional: bool = True):
  """Bool mask of block (i, j), broadcastable to ``[B, Hkv, G, bq, bk]``, or None
  when everything is allowed. ``positional=False`` leaves out the band and the
  key tail (for blocks that ``partial_blocks`` marks interior)."""
  spec = lay.spec
  rows = i * lay.block_q + jnp.arange(lay.block_q, dtype=jnp.int32)[:, None]
  cols = j * lay.block_kv + jnp.arange(lay.block_kv, dtype=jnp.int32)[None, :]
  ok = None
  if positional and not spec.band.is_full:
    ok = band_allowed(rows, cols, spec.band)
  if positional and lay.seq_k_padded != spec.seq_k:
    tail = cols < spec.seq_k
    ok = tail if ok is None else ok & tail
  if ok is not None:
    ok = ok[None, None, None]
  if prep.q_ids is not None:
    seg = (slice_q(prep.q_ids, lay, i, axis=1)[:, :, None] ==
           slice_kv(prep.kv_ids, lay, j, axis=1)[:, None, :])[:, None, None]
    ok = seg if ok is None else ok & seg
  if prep.mask is not None:
    m = slice_grouped(prep.mask, lay, i, j)
    ok = m if ok is None else ok & m
  return ok


def dropout_keep(prep: Prepared, lay: Layout, i, j):
  """Keep-mask ``[B, Hkv, G, bq, bk]`` of the common hash at global indices."""
  spec = lay.spec
  b = jnp.arange(spec.batch)[:, None, None, None]
  h = (jnp.arange(spec.heads_kv)[:, None] * spec.group_size +
       jnp.arange(spec.group_size)[None, :])[None, :, :, None]
  rows = (i * lay.block_q + jnp.arange(lay.block_q))[None, None, None, :]
  key = dropout_lib.row_key(prep.seed, b, h, rows)
  cols = j * lay.block_kv + jnp.arange(lay.block_kv)
  return dropout_lib.keep_from_row_key(key[..., None], cols, spec.dropout_rate)


def segment_ranges(prep: Prepared, lay: Layout):
  """Per-block (min, max) of segment ids, ``[B, nq]`` and ``[B, nk]`` each, or None.

  Two blocks whose id ranges are disjoint in every batch element share no id, so
  the block can be skipped; this holds for any ids, sorted or not.
  """
  if prep.q_ids is None:
    return None
  b = lay.spec.batch
  q = prep.q_ids.reshape(b, lay.num_q_blocks, lay.block_q)
  # Padded tails must not widen the ranges: use the last real id.
  kv = jnp.where(jnp.arange(lay.seq_k_padded) < lay.spec.seq_k, prep.kv_ids,
                 prep.kv_ids[:, lay.spec.seq_k - 1:lay.spec.seq_k])
  q = jnp.where(jnp.arange(lay.seq_q_padded).reshape(lay.num_q_blocks, lay.block_q)
                < lay.spec.seq_q, q, prep.q_ids[:, lay.spec.seq_q - 1, None, None])
  kv = kv.reshape(b, lay.num_kv_blocks, lay.block_kv)
  return (q.min(-1), q.max(-1)), (kv.min(-1), kv.max(-1))


def loop_blocks(step, prep: Prepared, lay: Layout, seg, outer, carry, *,
                over_kv: bool):
  """Runs ``step(inner, carry, positional)`` over the blocks that outer block
  ``outer`` reaches: kv blocks of q block ``outer`` (``over_kv``) or q blocks of
  kv block ``outer``.

  The band and the key tail cut blocks only at both ends of each range, so three
  loops (partial, interior, partial) apply the positional mask only where it is
  needed, with no per-block branch. Blocks whose segment ranges cannot meet are
  skipped with a cond (segment ids are data).
  """
  lo, a, b, hi = (jnp.asarray(x)[outer] for x in lay.split_ranges(over_kv))

  def body(positional):
    def run(inner, c):
      pair = (outer, inner) if over_kv else (inner, outer)
      if seg is None:
        return step(inner, c, positional)
      return jax.lax.cond(blocks_may_interact(seg, *pair),
                          lambda c: step(inner, c, positional), lambda c: c, c)
    return run

  carry = jax.lax.fori_loop(lo, a, body(True), carry)
  carry = jax.lax.fori_loop(a, b, body(False), carry)
  return jax.lax.fori_loop(b, hi, body(True), carry)


def blocks_may_interact(ranges, i, j):
  (qmin, qmax), (kmin, kmax) = ranges
  return jnp.any((qmin[:, i] <= kmax[:, j]) & (kmin[:, j] <= qmax[:, i]))
