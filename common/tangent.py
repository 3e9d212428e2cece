"""Forward-mode tangent of attention, blockwise in plain JAX (O(S) memory).

For logits ``s = cap * tanh(z / cap)`` with ``z = scale * q k^T + bias`` the
tangent is ``ds = (1 - tanh(z / cap)**2) * dz``, ``dz = scale * (dq k^T + q dk^T)
+ dbias``. With the forward's lse (sinks included) the probabilities are exact in
one pass, ``p = exp(s - lse)``, so no running max is needed (the backward kernels
use the lse the same way):

* ``dlse = sum_j p ds + sum_n p_sink dsink``
* ``dout = sum_j p' (ds v + dv) - dlse * out``, where ``p'`` is ``p`` with the
  dropout keep-mask of ``common/dropout.py`` applied and rescaled by
  ``1 / (1 - rate)`` (the forward's ``out`` already carries the same mask).

Rows that attend to nothing have lse ``-inf``: :func:`epilogue.safe_lse` turns it
into ``+inf`` so ``p`` is exactly 0 there, and both tangents are 0.

The loop runs over query blocks (``lax.map``) and, inside, over the key blocks
that the band lets them reach (``blocking.kv_block_table``; a ``fori_loop``), so
memory is ``O(block_q * block_kv)`` per batch and head on top of the inputs. Every
platform uses this one tangent for ``jax.jvp``; segment ids and dense masks do not
skip blocks (their entries contribute exact zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import blocking
from .blocking import pad_axis
from . import dropout as dropout_lib
from . import epilogue
from .compat import vary_like
from .mask import band_allowed
from .spec import AttentionSpec, Operands

# Key block of the loop. The query block is as tall as fits TILE_ELEMENTS score
# entries over all batches and heads (64 MiB per fp32 temporary), at least
# MIN_BLOCK_Q: few, large XLA steps (a step per small tile would be launch-bound on
# a GPU), with memory still linear in the sequence length.
BLOCK_KV = 256
MIN_BLOCK_Q = 128
TILE_ELEMENTS = 2**24


def default_block_q(spec: AttentionSpec, block_kv: int = BLOCK_KV) -> int:
  rows = TILE_ELEMENTS // (spec.batch * spec.heads_q * min(block_kv, spec.seq_k))
  return max(MIN_BLOCK_Q, rows)


def kv_block_ranges(spec: AttentionSpec, block_q: int, block_kv: int) -> np.ndarray:
  """``int32 [num_q_blocks, 2]``: the half-open range of key blocks that each query
  block's rows can reach through the band (``lo == hi`` where none)."""
  return blocking.kv_block_table(spec.band, block_q, block_kv)[:, [0, 3]]


def _rows(x, heads_kv: int):
  """``[B, S, Hq, X]`` -> ``[B, Hkv, G, S, X]`` (query groups next to their kv head)."""
  b, s, hq, d = x.shape
  return jnp.transpose(x.reshape(b, s, heads_kv, hq // heads_kv, d), (0, 2, 3, 1, 4))


def _grid5(x, heads_kv: int):
  """A rank-4 ``[b|1, Hq|1, Sq|1, Sk|1]`` operand as ``[b, Hkv|1, G|1, Sq|1, Sk|1]``."""
  b, h, sq, sk = x.shape
  if h == 1:
    return x.reshape(b, 1, 1, sq, sk)
  return x.reshape(b, heads_kv, h // heads_kv, sq, sk)


def _tile(x, i0, j0, bq, bk):
  """The ``[.., bq, bk]`` tile at rows ``i0``, columns ``j0`` of a grid operand
  whose last two dims are padded lengths or 1 (broadcast)."""
  if x.shape[-2] > 1:
    x = jax.lax.dynamic_slice_in_dim(x, i0, bq, x.ndim - 2)
  if x.shape[-1] > 1:
    x = jax.lax.dynamic_slice_in_dim(x, j0, bk, x.ndim - 1)
  return x


def attention_tangent(ops: Operands, tangents: Operands, spec: AttentionSpec, out,
                      lse, *, block_q: int | None = None, block_kv: int = BLOCK_KV):
  """Tangents ``(dout [B, Sq, Hq, Dv], dlse [B, Hq, Sq])`` of the attention.

  Args:
    ops: the primal operands.
    tangents: ``Operands`` holding the tangents of q, k, v, bias and sinks; None
      where an operand is absent or its tangent is zero (its terms are skipped);
      the other fields are ignored.
    spec: the call's spec.
    out, lse: the primal output ``[B, Sq, Hq, Dv]`` and lse ``[B, Hq, Sq]`` (the
      whole denominator, sinks included).
    block_q, block_kv: the loop's block sizes (``block_q`` by default from
      :func:`default_block_q`).

  Returns:
    ``dout`` in ``out``'s dtype and ``dlse`` in ``lse``'s dtype; linear in
    ``tangents``.
  """
  b, hkv, g = spec.batch, spec.heads_kv, spec.group_size
  sq, sk = spec.seq_q, spec.seq_k
  cdt = jnp.dtype(ops.q.dtype)
  acc = jnp.promote_types(cdt, jnp.float32)
  # fp32 products at full precision (TF32 would miss the fp32 tolerance); bf16
  # and fp16 inputs multiply in their own dtype with fp32 accumulation, as the
  # forward kernels do.
  prec = (jax.lax.Precision.HIGHEST if cdt.itemsize >= 4
          else jax.lax.Precision.DEFAULT)
  bk = min(block_kv, sk)
  bq = min(block_q or default_block_q(spec, block_kv), sq)
  ranges = jnp.asarray(kv_block_ranges(spec, bq, bk))
  nq, nk = -(-sq // bq), -(-sk // bk)
  sqp, skp = nq * bq, nk * bk

  def rows(x):  # [B, Sq, Hq, D] -> [B, Hkv, G, Sqp, D]
    return pad_axis(_rows(x.astype(cdt), hkv), 3, sqp)

  def keys(x):  # [B, Sk, Hkv, D] -> [B, Hkv, Skp, D]
    return pad_axis(jnp.transpose(x.astype(cdt), (0, 2, 1, 3)), 2, skp)

  maybe = lambda f, x: None if x is None else f(x)
  q, dq = rows(ops.q), maybe(rows, tangents.q)
  k, v = keys(ops.k), keys(ops.v)
  dk, dv = maybe(keys, tangents.k), maybe(keys, tangents.v)
  lse_rows = epilogue.safe_lse(lse.astype(acc)).reshape(b, hkv, g, sq)
  lse_rows = pad_axis(lse_rows, 3, sqp, jnp.inf)

  def grid(x, dtype):
    x = _grid5(x.astype(dtype), hkv)
    if x.shape[-2] > 1:
      x = pad_axis(x, 3, sqp)
    if x.shape[-1] > 1:
      x = pad_axis(x, 4, skp)
    return x

  bias = dbias = dense = None
  if ops.bias is not None:
    bias = grid(ops.bias, acc)
    dbias = maybe(lambda x: grid(x, acc), tangents.bias)
  if ops.mask is not None:
    dense = grid(ops.mask, jnp.bool_)
  seg = None
  if ops.q_segment_ids is not None:
    seg = (pad_axis(ops.q_segment_ids, 1, sqp), pad_axis(ops.kv_segment_ids, 1, skp))
  if spec.dropout_rate > 0:
    seed = dropout_lib.kernel_seed(ops.dropout_seed)
    seed, b_off, h_off = (jax.lax.bitcast_convert_type(seed[n], jnp.uint32)
                          for n in range(3))
    b_idx = jnp.arange(b, dtype=jnp.uint32)[:, None, None, None, None] + b_off
    h_idx = (jnp.arange(hkv * g, dtype=jnp.uint32).reshape(1, hkv, g, 1, 1)
             + h_off)
  varying = [x for x in (q, k, v, lse_rows, dq, dk, dv, bias, dbias, dense)
             if x is not None] + list(seg or ()) + (
                 [seed] if spec.dropout_rate > 0 else [])
  mm = lambda spec_, x, y: jnp.einsum(spec_, x, y, precision=prec,
                                      preferred_element_type=acc)

  def q_block(qi):
    i0 = qi * bq
    i = i0 + jnp.arange(bq, dtype=jnp.int32)
    q_b = jax.lax.dynamic_slice_in_dim(q, i0, bq, 3)
    lse_b = jax.lax.dynamic_slice_in_dim(lse_rows, i0, bq, 3)
    dq_b = None if dq is None else jax.lax.dynamic_slice_in_dim(dq, i0, bq, 3)
    if spec.dropout_rate > 0:
      row_key = dropout_lib.row_key(seed, b_idx, h_idx,
                                    i.astype(jnp.uint32)[:, None])

    def kv_step(kj, carry):
      a, dl = carry
      j0 = kj * bk
      j = j0 + jnp.arange(bk, dtype=jnp.int32)
      k_b = jax.lax.dynamic_slice_in_dim(k, j0, bk, 2)
      v_b = jax.lax.dynamic_slice_in_dim(v, j0, bk, 2)
      z = mm("bhgqd,bhkd->bhgqk", q_b, k_b) * spec.softmax_scale
      dz = jnp.zeros_like(z)
      if dq_b is not None:
        dz = dz + mm("bhgqd,bhkd->bhgqk", dq_b, k_b)
      if dk is not None:
        dk_b = jax.lax.dynamic_slice_in_dim(dk, j0, bk, 2)
        dz = dz + mm("bhgqd,bhkd->bhgqk", q_b, dk_b)
      dz = dz * spec.softmax_scale
      if bias is not None:
        z = z + _tile(bias, i0, j0, bq, bk)
      if dbias is not None:
        dz = dz + _tile(dbias, i0, j0, bq, bk)
      if spec.logits_soft_cap is not None:
        cap = spec.logits_soft_cap
        t = jnp.tanh(z / cap)
        z, dz = cap * t, (1.0 - t * t) * dz
      ok = (i[:, None] < sq) & (j[None, :] < sk)
      band = band_allowed(i[:, None], j[None, :], spec.band)
      ok = ok & band
      if seg is not None:
        q_ids = jax.lax.dynamic_slice_in_dim(seg[0], i0, bq, 1)
        kv_ids = jax.lax.dynamic_slice_in_dim(seg[1], j0, bk, 1)
        ok = ok & (q_ids[:, None, None, :, None] == kv_ids[:, None, None, None, :])
      if dense is not None:
        ok = ok & _tile(dense, i0, j0, bq, bk)
      p = jnp.where(ok, jnp.exp(z - lse_b[..., None]), 0.0)
      dl = dl + jnp.sum(p * dz, axis=-1)
      if spec.dropout_rate > 0:
        keep = dropout_lib.keep_from_row_key(row_key, j.astype(jnp.uint32),
                                             spec.dropout_rate)
        p = jnp.where(keep, p * dropout_lib.keep_scale(spec.dropout_rate), 0.0)
      a = a + mm("bhgqk,bhkd->bhgqd", (p * dz).astype(cdt), v_b)
      if dv is not None:
        dv_b = jax.lax.dynamic_slice_in_dim(dv, j0, bk, 2)
        a = a + mm("bhgqk,bhkd->bhgqd", p.astype(cdt), dv_b)
      return a, dl

    # Inside shard_map the body's sums vary along every axis its operands do;
    # the carry must start so too.
    init = (vary_like(jnp.zeros((b, hkv, g, bq, spec.head_dim_v), acc), *varying),
            vary_like(jnp.zeros((b, hkv, g, bq), acc), *varying))
    return jax.lax.fori_loop(ranges[qi, 0], ranges[qi, 1], kv_step, init)

  a, dl = jax.lax.map(q_block, jnp.arange(nq))
  # [nq, B, Hkv, G, bq, X] -> [B, Sq, Hq, X]
  a = jnp.moveaxis(a, 0, 3).reshape(b, hkv, g, sqp, -1)[:, :, :, :sq]
  a = jnp.transpose(a, (0, 3, 1, 2, 4)).reshape(b, sq, spec.heads_q, -1)
  dl = jnp.moveaxis(dl, 0, 3).reshape(b, spec.heads_q, sqp)[..., :sq]
  if tangents.sinks is not None:
    sinks = ops.sinks.astype(acc)[None, :, None, :]
    p_sink = jnp.exp(sinks - epilogue.safe_lse(lse.astype(acc))[..., None])
    dl = dl + jnp.sum(p_sink * tangents.sinks.astype(acc)[None, :, None, :], -1)
  dout = a - jnp.swapaxes(dl, 1, 2)[..., None] * out.astype(acc)
  return dout.astype(out.dtype), dl.astype(lse.dtype)
