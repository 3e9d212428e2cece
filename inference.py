"""Inference entry: ``flash_mha_with_kvcache`` (flash-attn3-jax's), contiguous and
paged caches, on every platform.

The semantics live in ``common/kvcache.py`` and the reference in
``common.reference.attention_with_kvcache``; this module validates, applies rotary
and the append once, and runs the platform's attention over the cache:

* ``xla``: a blockwise loop that gathers one block of the cache per step;
* ``pallas-tpu``: a paged decode kernel whose scalar-prefetched page table drives
  the page DMAs;
* GPU (``pallas`` or ``pallas-triton``): the Pallas-Triton split-KV decode kernel
  (pallas_gpu/triton/kvcache.py) where it applies (power-of-two head dims, at most
  64 query rows per key head, any page size), else the xla path (logged once);
  ``triton`` runs the xla path.

``flash_attention`` with few queries against many keys (decode, chunked prefill)
takes the same split-KV kernel on the Pallas GPU platforms, Mosaic-GPU's route and
Pallas-Triton (pallas_gpu/triton/decode.py); the triton platform runs its training
forward.
"""

from __future__ import annotations

import os

from . import registry
from .api import detect_backend
from .common import hardware
from .common import kvcache as kv
from .common.platform import traced_once


def _platform(backend: str, platform: str | None, spec: kv.KvCacheSpec,
              interpret: bool) -> str:
  """``"xla"``, ``"pallas-tpu"`` or ``"pallas-triton"`` for this call; raises for
  what cannot run."""
  platform = platform or os.environ.get("FLASHJAX_PLATFORM") or None
  name = None if platform is None else registry.resolve(platform, backend)
  if interpret and (name is None and backend != "tpu" or name is not None and
                    not name.startswith("pallas")):
    raise ValueError("interpret=True runs Pallas kernels in interpret mode; this "
                     f"call has none (platform {platform!r}, backend {backend!r}): "
                     "use platform='pallas' with backend='tpu'")
  if name is None:
    if backend == "tpu":
      from . import pallas_tpu
      reason = pallas_tpu.kvcache_supported(spec)
      if reason is None:
        return "pallas-tpu"
      registry.log_once(f"flashjax: flash_mha_with_kvcache runs xla; skipped: {reason}")
    elif backend == "gpu":
      reason = _gpu_reason(spec)
      if reason is None:
        return "pallas-triton"
      registry.log_once(f"flashjax: flash_mha_with_kvcache runs xla; skipped: {reason}")
    return "xla"
  runs_on = registry.PLATFORMS[name].backends
  if backend not in runs_on and not interpret:
    raise NotImplementedError(f"platform {platform!r} cannot run this call: {name}: "
                              f"not for backend {backend!r} (runs on "
                              f"{', '.join(runs_on)})")
  if name == "pallas-tpu":
    from . import pallas_tpu
    reason = pallas_tpu.kvcache_supported(spec)
    if reason is not None:
      raise NotImplementedError(f"platform {platform!r} cannot run this call: {reason}")
    return name
  if name in ("pallas-triton", "pallas-mosaic-gpu"):
    reason = _gpu_reason(spec)
    if reason is None:
      return "pallas-triton"
    registry.log_once(f"flashjax: flash_mha_with_kvcache runs xla; skipped: {reason}")
  elif name != "xla":
    registry.log_once(f"flashjax: flash_mha_with_kvcache has no {name} kernel yet; "
                      "running the xla path")
  return "xla"


def _gpu_reason(spec: kv.KvCacheSpec) -> str | None:
  from .pallas_gpu.triton import kvcache as triton_kvcache
  return triton_kvcache.supported(spec)


def flash_mha_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           cache_batch_idx=None, cache_leftpad=None, page_table=None,
                           rotary_cos=None, rotary_sin=None, softmax_scale=None,
                           is_causal=False, window_size=(-1, -1), num_splits=1,
                           return_softmax_lse=False, *, rotary_interleaved=True,
                           logits_soft_cap=None, sinks=None,
                           return_updated_cache=False, backend=None, platform=None,
                           config=None, interpret=False):
  """Attention of new queries over a KV cache, appending new keys first
  (flash-attn3-jax's ``flash_mha_with_kvcache``; semantics in ``docs/inference.md``).

  Args:
    q: ``[B, Sq, Hq, D]``.
    k_cache, v_cache: contiguous ``[B_cache, S_cache, Hkv, D]`` / ``[.., Dv]``, or
      paged ``[num_pages, page_size, Hkv, D]`` / ``[.., Dv]`` with ``page_table``.
    k, v: new keys/values ``[B, S_new, Hkv, D]`` / ``[.., Dv]``, written at
      positions ``cache_seqlens[b] ..`` and attended to.
    cache_seqlens: int or int32 ``[B]``: valid cache length before the append
      (default: the whole contiguous cache).
    cache_batch_idx: int32 ``[B]``: cache row of query row b (contiguous only).
    cache_leftpad: int32 ``[B]``: positions before it are padding.
    page_table: int32 ``[B, max_pages]``: position t of row b lives in page
      ``page_table[b, t // page_size]``.
    rotary_cos, rotary_sin: ``[S_ro, rotary_dim / 2]``; rotate q and k (needs k).
    softmax_scale: default ``1/sqrt(D)``.
    is_causal, window_size: bottom-right aligned on the end of the valid keys.
    num_splits: split-KV parts (0 = automatic, 1 = none); changes speed, never
      results. The GPU kernel splits; the xla path and the TPU kernel do not.
    return_softmax_lse: also return ``lse [B, Hq, Sq]`` (fp32).
    rotary_interleaved: True rotates pairs (0, 1), (2, 3)...; False the halves.
    logits_soft_cap: ``cap * tanh(logits / cap)``.
    sinks: ``[Hq]`` or ``[Hq, n]`` logits joining the denominator only.
    return_updated_cache: also return the caches with k, v written in.
    backend, platform, config, interpret: as ``flash_attention``; ``config`` is
      the chosen platform's (``xla_cpu.XlaConfig``, ``pallas_tpu.KvCacheConfig``,
      ``pallas_gpu.triton.DecodeConfig``).

  Returns:
    ``out [B, Sq, Hq, Dv]`` in q's dtype; with ``return_softmax_lse``
    ``(out, lse)``; with ``return_updated_cache`` the updated ``k_cache, v_cache``
    follow. Not differentiable (an inference entry).
  """
  if not isinstance(return_updated_cache, bool):
    raise ValueError(f"return_updated_cache must be a bool, got "
                     f"{return_updated_cache!r}")
  ops, spec = kv.canonicalize(
      q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
      cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
      page_table=page_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
      rotary_interleaved=rotary_interleaved, softmax_scale=softmax_scale,
      causal=is_causal, window_size=window_size, logits_soft_cap=logits_soft_cap,
      sinks=sinks, num_splits=num_splits, return_lse=return_softmax_lse)
  name = _platform(detect_backend(backend, q), platform, spec, interpret)
  prep = kv.prepare(ops, spec)
  # Each kernel lowers once per program, however many layers call it.
  if name == "pallas-tpu":
    from . import pallas_tpu
    out, lse = traced_once(pallas_tpu.kvcache_attention, (2, 3), ("interpret",))(
        prep, ops.sinks, spec, config, interpret=interpret)
  elif name == "pallas-triton":
    from .pallas_gpu.triton import kvcache as triton_kvcache
    out, lse = traced_once(triton_kvcache.attention, (2, 3, 4), ("interpret",))(
        prep, ops.sinks, spec, config, hardware.num_sms(), interpret=interpret)
  else:
    from .xla_cpu import kvcache as xla_kvcache
    out, lse = traced_once(xla_kvcache.attention, (2, 3))(prep, ops.sinks, spec,
                                                          config)
  result = (out, lse) if return_softmax_lse else (out,)
  if return_updated_cache:
    result += (prep.k_cache, prep.v_cache)
  return result[0] if len(result) == 1 else result
