"""jax-flash-attn2's entry: ``get_cached_flash_attention`` and its environment
variables (``BLOCKSIZE_M_FLASH_ATTN``, ``BLOCKSIZE_N_FLASH_ATTN``, ``FORCE_MHA``),
translated into the contract and run by the frontend's dispatch."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp

from .. import api, registry
from ..common import env
from ..common import spec as spec_lib


def _env_flag(name: str) -> bool:
  return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def _repeat_kv_heads(q, k, v):
  """``k``, ``v`` with each head repeated to q's head count (``FORCE_MHA``)."""
  if getattr(k, "ndim", 0) == 4 and getattr(q, "ndim", 0) == 4 and (
      q.shape[2] != k.shape[2] and q.shape[2] % k.shape[2] == 0):
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  return k, v


def get_cached_flash_attention(backend=None, platform=None, blocksize_q=None,
                               blocksize_k=None, softmax_scale=None):
  """jax-flash-attn2's entry: a cached callable
  ``attention(query, key, value, bias=None, ...)``; the same arguments give the
  same object.

  Block sizes default to the environment variables ``BLOCKSIZE_M_FLASH_ATTN`` /
  ``BLOCKSIZE_N_FLASH_ATTN`` when set, else to the platform's heuristic. With
  ``FORCE_MHA=1`` (read when the callable runs) K and V heads are repeated to the
  query heads first, as jax-flash-attn2 does for kernels without GQA.
  """
  for name, value in (("blocksize_q", blocksize_q), ("blocksize_k", blocksize_k)):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
      raise ValueError(f"{name} must be a positive int or None, got {value!r}")
  if softmax_scale is not None:
    spec_lib.static_number(softmax_scale, "softmax_scale")
  for name, value in (("backend", backend), ("platform", platform)):
    if value is not None and not isinstance(value, str):
      raise ValueError(f"{name} must be a string or None, got {value!r}")
  return _cached_flash_attention(backend, platform, blocksize_q, blocksize_k,
                                 softmax_scale)


@functools.lru_cache(maxsize=None)
def _cached_flash_attention(backend, platform, blocksize_q, blocksize_k,
                            softmax_scale):
  if platform is not None:
    registry.resolve(platform, backend or "gpu")  # validate early
  if blocksize_q is None:
    blocksize_q = env.positive_int("BLOCKSIZE_M_FLASH_ATTN")
  if blocksize_k is None:
    blocksize_k = env.positive_int("BLOCKSIZE_N_FLASH_ATTN")
  blocks = None if blocksize_q is None and blocksize_k is None else (
      blocksize_q, blocksize_k)

  def attention(query, key, value, bias=None, attention_mask=None, causal=False,
                dropout_prob=0.0, dropout_seed=None, sliding_window=None,
                logits_soft_cap=None, segment_ids=None, sinks=None,
                return_lse=False):
    """``[B, S, H, D]`` attention; ``attention_mask`` is a bool mask
    broadcastable to ``[B, H, Sq, Sk]`` or a ``[B, Sk]`` key-padding mask (see
    ``_two_dim_mask`` for how a 2-D mask is read)."""
    if _env_flag("FORCE_MHA"):
      key, value = _repeat_kv_heads(query, key, value)
    kpm = None
    if attention_mask is not None and getattr(attention_mask, "ndim", None) == 2:
      if _two_dim_mask(attention_mask.shape, query, key) == "key_padding":
        kpm, attention_mask = attention_mask.astype(bool), None
    segs = segment_ids
    if kpm is not None:
      segs = api.key_padding_to_segments(kpm, query, key, segment_ids)
    ops, spec = spec_lib.canonicalize(
        query, key, value, bias=bias, mask=attention_mask, causal=causal,
        sliding_window=sliding_window, segment_ids=segs,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
        dropout_rate=dropout_prob, dropout_seed=dropout_seed,
        return_lse=return_lse)
    out, lse = api.dispatch(ops, spec, backend=api.detect_backend(backend, query),
                        platform=platform, block_sizes=blocks)
    return (out, lse) if return_lse else out

  return attention


def _two_dim_mask(shape, query, key) -> str:
  """How a 2-D ``attention_mask`` is read: ``[B, Sk]`` is key padding,
  ``[Sq, Sk]`` a mask shared by the batch. When ``B == Sq`` both readings fit and
  the call raises instead of guessing; ``[B, 1, 1, Sk]`` (key padding) or
  ``[1, 1, Sq, Sk]`` (shared) say it explicitly."""
  b, sq, sk = query.shape[0], query.shape[1], key.shape[1]
  padding, shared = tuple(shape) == (b, sk), tuple(shape) == (sq, sk)
  if padding and shared:
    raise ValueError(
        f"attention_mask of shape {tuple(shape)} is ambiguous: B = Sq = {b}, so it "
        "may be a [B, Sk] key-padding mask or an [Sq, Sk] mask; pass it as "
        f"[B, 1, 1, Sk] = [{b}, 1, 1, {sk}] (key padding) or [1, 1, Sq, Sk] = "
        f"[1, 1, {sq}, {sk}] (one mask for every batch element)")
  return "key_padding" if padding else "broadcast"
