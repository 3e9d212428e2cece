"""The reference: dense attention with every feature of the contract.

Materialises ``[B, Hq, Sq, Sk]``, so it is for tests and small problems only. It is
the oracle: outputs stay in the compute precision (fp32 at ``Precision.HIGHEST``, or
fp64 when x64 is enabled and asked for) instead of being rounded to the input dtype,
and its gradients come from autodiff. Fully masked rows give output 0, lse ``-inf``
and zero gradients, with no NaN anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import dropout as dropout_lib
from .mask import Band, Mask
from .spec import AttentionSpec, Operands, canonicalize

_HIGHEST = jax.lax.Precision.HIGHEST


def _compute_dtype(precision: str | None):
  if precision is None:
    precision = "float64" if jax.config.read("jax_enable_x64") else "float32"
  if precision == "float64" and not jax.config.read("jax_enable_x64"):
    raise ValueError("precision='float64' needs jax_enable_x64")
  if precision not in ("float32", "float64"):
    raise ValueError(f"precision must be 'float32' or 'float64', got {precision!r}")
  return jnp.dtype(precision)


def mask_of(ops: Operands, spec: AttentionSpec) -> Mask:
  seg = None
  if ops.q_segment_ids is not None:
    seg = (ops.q_segment_ids, ops.kv_segment_ids)
  return Mask(band=spec.band, segment_ids=seg, dense=ops.mask)


def logits(ops: Operands, spec: AttentionSpec, dtype):
  """Scaled, biased, soft-capped logits ``[B, Hq, Sq, Sk]`` (before masking)."""
  q = ops.q.astype(dtype)
  k = jnp.repeat(ops.k.astype(dtype), spec.group_size, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST) * spec.softmax_scale
  if ops.bias is not None:
    s = s + ops.bias.astype(dtype)
  if spec.logits_soft_cap is not None:
    cap = spec.logits_soft_cap
    s = cap * jnp.tanh(s / cap)
  return s


def dropout_keep(ops: Operands, spec: AttentionSpec):
  """The keep-mask ``[B, Hq, Sq, Sk]`` of the common hash."""
  b = jnp.arange(spec.batch)[:, None, None, None]
  h = jnp.arange(spec.heads_q)[None, :, None, None]
  i = jnp.arange(spec.seq_q)[None, None, :, None]
  j = jnp.arange(spec.seq_k)[None, None, None, :]
  return dropout_lib.keep(ops.dropout_seed, b, h, i, j, spec.dropout_rate)


def attention_from_operands(ops: Operands, spec: AttentionSpec, precision=None):
  """Returns ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq])`` in the compute dtype."""
  dtype = _compute_dtype(precision)
  s = logits(ops, spec, dtype)
  allowed = jnp.broadcast_to(mask_of(ops, spec).as_array(), s.shape)
  s = jnp.where(allowed, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  if ops.sinks is not None:
    sinks = ops.sinks.astype(dtype)[None, :, None, :]
    m = jnp.maximum(m, jnp.max(sinks, axis=-1))
  # The shift only stabilises exp; stop_gradient keeps -inf rows out of autodiff.
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.exp(s - m[..., None])
  denom = jnp.sum(e, axis=-1)
  if ops.sinks is not None:
    denom = denom + jnp.sum(jnp.exp(sinks - m[..., None]), axis=-1)
  empty = denom == 0
  safe = jnp.where(empty, 1.0, denom)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(safe))
  p = e / safe[..., None]
  if spec.dropout_rate > 0:
    p = jnp.where(dropout_keep(ops, spec), p / (1.0 - spec.dropout_rate), 0.0)
  v = jnp.repeat(ops.v.astype(dtype), spec.group_size, axis=2)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=_HIGHEST)
  return out, lse


def attention(q, k, v, *, precision=None, **kwargs):
  """Reference attention with the contract's keyword arguments.

  Args:
    q, k, v: ``[B, Sq, Hq, D]``, ``[B, Sk, Hkv, D]``, ``[B, Sk, Hkv, Dv]``.
    precision: "float32" (default) or "float64" (needs x64); the dtype of the
      computation and of the results.
    **kwargs: bias, mask, causal, sliding_window, segment_ids, softmax_scale,
      logits_soft_cap, sinks, dropout_rate, dropout_seed, return_lse.

  Returns:
    ``out [B, Sq, Hq, Dv]``, or ``(out, lse [B, Hq, Sq])`` with ``return_lse``.
  """
  ops, spec = canonicalize(q, k, v, **kwargs)
  out, lse = attention_from_operands(ops, spec, precision)
  return (out, lse) if spec.return_lse else out


__all__ = ["attention", "attention_from_operands", "logits", "mask_of",
           "dropout_keep", "Band"]


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, precision=None,
                           **kwargs):
  """Reference of ``flash_mha_with_kvcache``: rotary and the append
  (``common.kvcache``), then every batch row's whole cache gathered densely and
  attended through :func:`attention` with the row's valid positions and its
  bottom-right aligned band as a dense mask.

  Args:
    q, k_cache, v_cache, k, v: as ``flash_mha_with_kvcache``.
    precision: "float32" (default) or "float64".
    **kwargs: ``common.kvcache.canonicalize``'s keyword arguments.

  Returns:
    ``(out [B, Sq, Hq, Dv], lse [B, Hq, Sq], k_cache, v_cache)``: the output and
    lse in the compute dtype, the caches updated with the new keys.
  """
  from . import kvcache  # kvcache imports nothing of the reference's
  ops, spec = kvcache.canonicalize(q, k_cache, v_cache, k, v, **kwargs)
  prep = kvcache.prepare(ops, spec)
  if spec.paged:
    # Table entries past a row's valid pages may hold anything: clip them.
    pages = jnp.clip(prep.rows, 0, spec.cache_rows - 1)
    gather = lambda c: c[pages].reshape((spec.batch, spec.capacity) + c.shape[2:])
  else:
    gather = lambda c: c[prep.rows]
  pos = jnp.arange(spec.capacity, dtype=jnp.int32)[None, None, :]
  row = jnp.arange(spec.seq_q, dtype=jnp.int32)[None, :, None]
  mask = kvcache.key_allowed(pos, row, prep.total[:, None, None],
                             prep.leftpad[:, None, None], spec)[:, None]
  # Free slots are never read (they may hold anything, NaN included).
  held = kvcache.key_held(pos[0], prep.total[:, None], prep.leftpad[:, None])
  keep = lambda c: jnp.where(held[:, :, None, None], gather(c), 0)
  out, lse = attention(prep.q, keep(prep.k_cache), keep(prep.v_cache),
                       mask=mask, softmax_scale=spec.softmax_scale,
                       logits_soft_cap=spec.logits_soft_cap, sinks=ops.sinks,
                       return_lse=True, precision=precision)
  return out, lse, prep.k_cache, prep.v_cache
