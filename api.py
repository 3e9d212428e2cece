"""The public API: one contract, the seeds' entry points, platform dispatch."""

from __future__ import annotations

import functools
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import registry
from .common import env
from .common import spec as spec_lib
from .common import vjp

BACKENDS = ("cpu", "gpu", "tpu")


def _env_flag(name: str) -> bool:
  return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def detect_backend(backend, q) -> str:
  """``backend`` if given, else the inputs' device platform, else JAX's default."""
  if backend is not None:
    if backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend
  try:
    devices = q.devices()  # concrete arrays only; tracers raise
  except Exception:
    devices = None
  if devices:
    plat = next(iter(devices)).platform
    return "gpu" if plat in ("cuda", "rocm", "gpu") else plat
  plat = jax.default_backend()
  return "gpu" if plat in ("cuda", "rocm") else plat


def _call(name, ops, spec, config, block_sizes, interpret):
  if interpret and not name.startswith("pallas"):
    raise ValueError(f"interpret=True runs Pallas kernels in interpret mode; platform"
                     f" {name!r} has none (use platform='pallas' or 'pallas-triton')")
  mod = registry.load(name)
  if config is None and block_sizes is not None and hasattr(
      mod, "config_from_block_sizes"):
    config = mod.config_from_block_sizes(spec, *block_sizes)
  kwargs = {"interpret": interpret} if interpret else {}
  return mod.attention_from_operands(ops, spec, config, **kwargs)


def dispatch(ops, spec, *, backend: str, platform: str | None = None, config=None,
             block_sizes=None, interpret: bool = False):
  """Runs the named platform, or the first of the backend's preferred order that
  can; returns ``(out, lse)``."""
  platform = platform or os.environ.get("FLASHJAX_PLATFORM") or None
  if platform is not None:
    name = registry.resolve(platform, backend)
    reason = registry.reason_unsupported(name, spec, backend if not interpret else
                                         registry.PLATFORMS[name].backends[0])
    if reason:
      raise NotImplementedError(f"platform {platform!r} cannot run this call: {reason}")
    return _call(name, ops, spec, config, block_sizes, interpret)
  reasons = []
  for name in registry.preferred_order(backend):
    reason = registry.reason_unsupported(name, spec, backend)
    if reason is None and interpret and not name.startswith("pallas"):
      reason = f"{name}: has no interpret mode (interpret=True)"
    if reason is None:
      try:
        result = _call(name, ops, spec, config, block_sizes, interpret)
      except vjp.SecondOrderError:
        raise  # not a gap of this platform: every platform says the same
      except NotImplementedError as e:
        reason = f"{name}: {e}"
      else:
        if reasons:
          registry.log_once(f"flashjax: running {name}; skipped: " + "; ".join(reasons))
        return result
    reasons.append(reason)
  raise NotImplementedError("no platform can run this call on backend "
                            f"{backend!r}:\n  " + "\n  ".join(reasons))


def flash_attention(q, k, v, *, bias=None, mask=None, causal=False,
                    sliding_window=None, segment_ids=None, key_padding_mask=None,
                    softmax_scale=None, logits_soft_cap=None, sinks=None,
                    dropout_rate=0.0, dropout_seed=None, return_lse=False,
                    backend=None, platform=None, config=None, interpret=False):
  """Exact attention with the flashjax contract, on the best platform available.

  Args:
    q: ``[B, Sq, Hq, D]``.
    k: ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0``.
    v: ``[B, Sk, Hkv, Dv]``.
    bias: additive, broadcastable to ``[B, Hq, Sq, Sk]``; differentiable.
    mask: bool, broadcastable to ``[B, Hq, Sq, Sk]``; True = attend.
    causal: query i sees key j iff ``j <= i + Sk - Sq`` (bottom-right aligned).
    sliding_window: ``(left, right)`` around that diagonal (-1/None unbounded),
      or an int ``w`` meaning ``(w, 0)``.
    segment_ids: ``(q_ids [B, Sq], kv_ids [B, Sk])`` ints; attend within equal ids.
    key_padding_mask: bool ``[B, Sk]``, True = real key (lucidrains' form);
      lowered to segment ids, so no ``[Sq, Sk]`` mask is built.
    softmax_scale: default ``1/sqrt(D)``.
    logits_soft_cap: ``cap * tanh(logits / cap)`` after scale and bias.
    sinks: ``[Hq]`` or ``[Hq, n]`` logits joining the denominator only.
    dropout_rate, dropout_seed: dropout on probabilities (common hash).
    return_lse: also return ``lse [B, Hq, Sq]`` (fp32).
    backend: "cpu" | "gpu" | "tpu"; default from the inputs' devices.
    platform: "xla" (alias "jax"), "pallas", "pallas-triton", "triton"; default:
      the backend's preferred order, falling through on NotImplementedError.
      Also set by the environment variable ``FLASHJAX_PLATFORM``.
    config: the chosen platform's tuning config (e.g. ``xla_cpu.XlaConfig``).
    interpret: run Pallas kernels in interpret mode (CPU, for checking logic).

  Returns:
    ``out [B, Sq, Hq, Dv]`` in q's dtype, or ``(out, lse)``.
  """
  if key_padding_mask is not None:
    segment_ids = _key_padding_to_segments(key_padding_mask, q, k, segment_ids)
  from . import ring  # q, k, v split along the sequence: a ring, not a gather
  route = ring.sequence_axis(q, k)
  if route is not None:
    return ring.sharded_call(
        route, q, k, v, bias=bias, mask=mask, causal=causal,
        sliding_window=sliding_window, segment_ids=segment_ids,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
        dropout_rate=dropout_rate, dropout_seed=dropout_seed, return_lse=return_lse,
        backend=backend, platform=platform, config=config, interpret=interpret)
  if _env_flag("FORCE_MHA") and getattr(k, "ndim", 0) == 4 and getattr(
      q, "ndim", 0) == 4 and q.shape[2] != k.shape[2] and q.shape[2] % k.shape[2] == 0:
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  ops, spec = spec_lib.canonicalize(
      q, k, v, bias=bias, mask=mask, causal=causal, sliding_window=sliding_window,
      segment_ids=segment_ids, softmax_scale=softmax_scale,
      logits_soft_cap=logits_soft_cap, sinks=sinks, dropout_rate=dropout_rate,
      dropout_seed=dropout_seed, return_lse=return_lse)
  out, lse = dispatch(ops, spec, backend=detect_backend(backend, q),
                      platform=platform, config=config, interpret=interpret)
  return (out, lse) if return_lse else out


def _key_padding_to_segments(key_padding_mask, q, k, segment_ids):
  b, sk = k.shape[0], k.shape[1]
  if getattr(key_padding_mask, "shape", None) != (b, sk) or (
      key_padding_mask.dtype != jnp.bool_):
    raise ValueError(f"key_padding_mask must be bool [B, Sk] = [{b}, {sk}], got "
                     f"{getattr(key_padding_mask, 'shape', key_padding_mask)!r} "
                     f"{getattr(key_padding_mask, 'dtype', '')}")
  if segment_ids is None:
    q_ids = jnp.zeros((b, q.shape[1]), jnp.int32)
    kv_ids = jnp.zeros((b, sk), jnp.int32)
  else:
    q_ids, kv_ids = spec_lib.int32_segment_ids(*(jnp.asarray(x) for x in segment_ids))
  # Padded keys get an id no query has.
  none = jnp.min(q_ids, axis=1, keepdims=True) - 1
  return q_ids, jnp.where(key_padding_mask, kv_ids, none)


# -- jax-flash-attn2 ---------------------------------------------------------------


def get_cached_flash_attention(backend=None, platform=None, blocksize_q=None,
                               blocksize_k=None, softmax_scale=None):
  """jax-flash-attn2's entry: a cached callable
  ``attention(query, key, value, bias=None, ...)``; the same arguments give the
  same object.

  Block sizes default to the environment variables ``BLOCKSIZE_M_FLASH_ATTN`` /
  ``BLOCKSIZE_N_FLASH_ATTN`` when set, else to the platform's heuristic.
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
    kpm = None
    if attention_mask is not None and getattr(attention_mask, "ndim", None) == 2:
      if _two_dim_mask(attention_mask.shape, query, key) == "key_padding":
        kpm, attention_mask = attention_mask.astype(bool), None
    segs = segment_ids
    if kpm is not None:
      segs = _key_padding_to_segments(kpm, query, key, segment_ids)
    ops, spec = spec_lib.canonicalize(
        query, key, value, bias=bias, mask=attention_mask, causal=causal,
        sliding_window=sliding_window, segment_ids=segs,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
        dropout_rate=dropout_prob, dropout_seed=dropout_seed,
        return_lse=return_lse)
    out, lse = dispatch(ops, spec, backend=detect_backend(backend, query),
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


# -- flash-attn-jax / flash-attn3-jax ---------------------------------------------


def _window_pair(window_size) -> tuple:
  """flash-attn's ``window_size``: a ``(left, right)`` pair, -1 = unbounded."""
  if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
    raise ValueError("window_size must be a (left, right) pair of ints (-1 = "
                     f"unbounded), got {window_size!r}")
  return tuple(window_size)


def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
  """flash-attn-jax's entry: ``[B, S, H, D]``, ``window_size=(left, right)``."""
  return flash_attention(q, k, v, softmax_scale=softmax_scale, causal=is_causal,
                         sliding_window=_window_pair(window_size))


def _cu_to_ids(cu, total, pad_id):
  pos = jnp.arange(total)
  ids = jnp.searchsorted(cu, pos, side="right").astype(jnp.int32) - 1
  return jnp.where(pos < cu[-1], ids, pad_id)


def _end_aligned_layout(cu_q, cu_k, total_q, total_k):
  """Positions of packed q and k rows in a layout where sequence ``s`` occupies a
  slot of ``max(len_q, len_k)`` and both its q and its k rows end at the slot's
  end. In that layout one causal/window band with offset 0 (plus segment ids) is
  each sequence's own bottom-right aligned band: key j of s is visible to query i
  of s iff ``j <= i + len_k - len_q`` iff ``pos_k <= pos_q``. The layout has
  ``total_q + total_k`` rows, a bound on the sum of slots known at trace time."""
  len_q, len_k = jnp.diff(cu_q), jnp.diff(cu_k)
  slot_end = jnp.cumsum(jnp.maximum(len_q, len_k))

  def positions(cu, lens, total):
    rows = jnp.arange(total)
    s = jnp.clip(jnp.searchsorted(cu, rows, side="right") - 1, 0, lens.shape[0] - 1)
    real = rows < cu[-1]
    # Padding rows park past every slot, each on a row of its own.
    return jnp.where(real, slot_end[s] - lens[s] + rows - cu[s],
                     slot_end[-1] + rows - cu[-1])

  return positions(cu_q, len_q, total_q), positions(cu_k, len_k, total_k)


def _check_offsets(name, cu, total):
  """``ValueError`` unless concrete offsets ``cu`` start at 0, never decrease and
  end at most at ``total``; traced offsets pass unchecked (see flash_mha_varlen)."""
  if isinstance(cu, jax.core.Tracer):
    return
  offsets = np.asarray(cu)
  if offsets.size == 0 or offsets[0] != 0:
    raise ValueError(f"{name} must start at 0, got {offsets.tolist()}")
  if np.any(np.diff(offsets) < 0):
    raise ValueError(f"{name} must be non-decreasing, got {offsets.tolist()}")
  if offsets[-1] > total:
    raise ValueError(f"{name} ends at {int(offsets[-1])}, past the {total} packed "
                     f"rows: {offsets.tolist()}")


def flash_mha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale=None, is_causal=False,
                     window_size=(-1, -1)):
  """flash-attn3-jax's varlen entry on packed ``[total, H, D]`` inputs.

  Sequence ``s`` is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and
  ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k/v; positions past the last offset are
  padding (output 0). Lowered to segment ids (no ``[S, S]`` mask). Causal and
  window bands are aligned bottom-right per sequence, as in FlashAttention: with
  different q and k lengths, query i of a sequence sees key j iff
  ``j <= i + len_k - len_q`` (and ``j >= i + len_k - len_q - left``). When
  ``cu_seqlens_q is cu_seqlens_k`` this runs on the packed rows directly;
  otherwise rows are moved to an end-aligned layout of ``total_q + total_k`` rows
  first (more work, same result).

  Concrete offsets are checked: each must start at 0, never decrease and end at
  most at its total, else ``ValueError``. Under ``jit`` the offsets are traced
  values and are not checked: offsets that break these rules give unspecified
  output (no error, no NaN guarantee), so validate them before tracing.
  ``max_seqlen_q`` / ``max_seqlen_k`` are static ints (Python or numpy/JAX
  integer scalars outside jit); they are checked, not used.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 3:
      raise ValueError(f"{name} must be packed [total, H, D], got shape "
                       f"{getattr(x, 'shape', None)}")
  for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
    if getattr(cu, "ndim", None) != 1 or not jnp.issubdtype(cu.dtype, jnp.integer):
      raise ValueError(f"{name} must be a 1-D int array of offsets, got "
                       f"{getattr(cu, 'shape', cu)}")
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length, got "
                     f"{cu_seqlens_q.shape} and {cu_seqlens_k.shape}")
  for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
    try:
      ok = not isinstance(m, bool) and operator.index(m) >= 1
    except TypeError:  # not an integer, or a traced value
      ok = False
    if not ok:
      raise ValueError(f"{name} must be a positive int (static), got {m!r}")
  _check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
  _check_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
  window_size = _window_pair(window_size)
  banded = is_causal or tuple(window_size) != (-1, -1)
  if banded and (cu_seqlens_q is not cu_seqlens_k or q.shape[0] != k.shape[0]):
    pos_q, pos_k = _end_aligned_layout(cu_seqlens_q, cu_seqlens_k, q.shape[0],
                                       k.shape[0])
    rows = q.shape[0] + k.shape[0]
    place = lambda x, pos: jnp.zeros((rows,) + x.shape[1:], x.dtype).at[pos].set(
        x, unique_indices=True)
    # Ids: the sequence on its rows, -1 / -2 on q / k filler and padding rows
    # (never equal, so those rows attend to nothing and output 0).
    q_ids = jnp.full((rows,), -1, jnp.int32).at[pos_q].set(
        _cu_to_ids(cu_seqlens_q, q.shape[0], -1))
    kv_ids = jnp.full((rows,), -2, jnp.int32).at[pos_k].set(
        _cu_to_ids(cu_seqlens_k, k.shape[0], -2))
    out = flash_attention(place(q, pos_q)[None], place(k, pos_k)[None],
                          place(v, pos_k)[None], softmax_scale=softmax_scale,
                          causal=is_causal, sliding_window=tuple(window_size),
                          segment_ids=(q_ids[None], kv_ids[None]))
    return out[0, pos_q]
  q_ids = _cu_to_ids(cu_seqlens_q, q.shape[0], -1)
  kv_ids = _cu_to_ids(cu_seqlens_k, k.shape[0], -2)
  out = flash_attention(q[None], k[None], v[None], softmax_scale=softmax_scale,
                        causal=is_causal, sliding_window=tuple(window_size),
                        segment_ids=(q_ids[None], kv_ids[None]))
  return out[0]
