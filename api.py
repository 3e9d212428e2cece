"""The public API: the contract's entry and the platform dispatch. The seeds'
entry points live in compat/ (jax_flash_attn2.py, flash_attn_jax.py, ...)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from . import registry
from .common import spec as spec_lib
from .common import vjp

BACKENDS = ("cpu", "gpu", "tpu")


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
  mod = registry.load(name)
  if interpret and not mod.CAPABILITIES.interpret:
    raise ValueError(f"interpret=True runs Pallas kernels in interpret mode; platform"
                     f" {name!r} has none (use platform='pallas' with backend='tpu',"
                     " or 'pallas-triton')")
  if config is None and block_sizes is not None and hasattr(
      mod, "config_from_block_sizes"):
    config = mod.config_from_block_sizes(spec, *block_sizes)
  kwargs = {"interpret": interpret} if interpret else {}
  try:
    return mod.attention_from_operands(ops, spec, config, **kwargs)
  except NotImplementedError as e:
    if type(e) is not NotImplementedError:  # vjp.SecondOrderError: not this platform's
      raise
    raise NotImplementedError(f"{name}: {e}") from e


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
  order = registry.preferred_order(backend)
  if config is not None:
    order = [_platform_of_config(config, order, spec, backend)]
  reasons = []
  for name in order:
    reason = registry.reason_unsupported(name, spec, backend)
    if reason is None and interpret and not registry.load(name).CAPABILITIES.interpret:
      reason = f"{name}: has no interpret mode (interpret=True)"
    if reason is None:
      try:
        result = _call(name, ops, spec, config, block_sizes, interpret)
      except vjp.SecondOrderError:
        raise  # not a gap of this platform: every platform says the same
      except NotImplementedError as e:
        reason = str(e)
      else:
        if reasons:
          registry.log_once(f"flashjax: running {name}; skipped: " + "; ".join(reasons))
        return result
    reasons.append(reason)
  raise NotImplementedError("no platform can run this call on backend "
                            f"{backend!r}:\n  " + "\n  ".join(reasons))


def _platform_of_config(config, order, spec, backend) -> str:
  """The platform of ``order`` whose config ``config`` is: a config is never
  handed to another platform (a Mosaic config reaching Triton would be read
  wrongly or not at all). ``ValueError`` naming the config's type and the platform
  the automatic choice takes if none is."""
  for name in order:
    try:
      if type(config) is registry.load(name).CONFIG:
        return name
    except NotImplementedError:  # does not import here
      continue
  chosen = next((n for n in order if registry.reason_unsupported(n, spec, backend)
                 is None), order[-1])
  raise ValueError(
      f"config is a {type(config).__name__}, not a config of the platform the "
      f"automatic choice takes here ({chosen!r} on backend {backend!r}, which takes "
      f"a {registry.load(chosen).CONFIG.__name__}) nor of another in its order "
      f"{order}: pass platform= naming the config's platform, or no config")


def flash_attention(q, k, v, *, bias=None, mask=None, causal=False,
                    sliding_window=None, segment_ids=None, key_padding_mask=None,
                    softmax_scale=None, logits_soft_cap=None, sinks=None,
                    dropout_rate=0.0, dropout_seed=None, return_lse=False,
                    contiguous_segments=False, backend=None, platform=None,
                    config=None, interpret=False):
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
    contiguous_segments: the promise that in every row of ``segment_ids``, q's
      and kv's, each id's positions form one unbroken run and the ids lie in
      ``[-S, S)`` for their side's length ``S`` (packed documents numbered from
      0, a negative padding id included). Kernels may then mask by position
      spans instead of comparing ids (the Hopper kernels do). Checked where the
      ids are concrete (``ValueError``); under ``jit``, ids that break it give
      undefined results.
    backend: "cpu" | "gpu" | "tpu"; default from the inputs' devices.
    platform: "xla" (alias "jax"), "pallas", "pallas-triton", "triton"; default:
      the backend's preferred order, falling through on NotImplementedError.
      Also set by the environment variable ``FLASHJAX_PLATFORM``.
    config: a platform's tuning config (e.g. ``xla_cpu.XlaConfig``); with
      automatic choice it pins the call to that platform (``ValueError`` if it
      is not in the backend's order).
    interpret: run Pallas kernels in interpret mode (CPU, for checking logic).

  Returns:
    ``out [B, Sq, Hq, Dv]`` in q's dtype, or ``(out, lse)``.
  """
  if key_padding_mask is not None:
    segment_ids = key_padding_to_segments(key_padding_mask, q, k, segment_ids)
  from . import ring  # q, k, v split along the sequence: a ring, not a gather
  route = ring.sequence_axis(q, k)
  if route is not None:
    if contiguous_segments and segment_ids is not None:
      spec_lib.check_contiguous_segments(segment_ids)  # before the shards hide it
    return ring.sharded_call(
        route, q, k, v, bias=bias, mask=mask, causal=causal,
        sliding_window=sliding_window, segment_ids=segment_ids,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
        dropout_rate=dropout_rate, dropout_seed=dropout_seed, return_lse=return_lse,
        contiguous_segments=contiguous_segments, backend=backend, platform=platform,
        config=config, interpret=interpret)
  ops, spec = spec_lib.canonicalize(
      q, k, v, bias=bias, mask=mask, causal=causal, sliding_window=sliding_window,
      segment_ids=segment_ids, softmax_scale=softmax_scale,
      logits_soft_cap=logits_soft_cap, sinks=sinks, dropout_rate=dropout_rate,
      dropout_seed=dropout_seed, return_lse=return_lse,
      contiguous_segments=contiguous_segments)
  out, lse = dispatch(ops, spec, backend=detect_backend(backend, q),
                      platform=platform, config=config, interpret=interpret)
  return (out, lse) if return_lse else out


def key_padding_to_segments(key_padding_mask, q, k, segment_ids):
  """lucidrains' bool ``[B, Sk]`` key-padding mask (True = real key) as segment ids
  (combined with ``segment_ids`` if given): padded keys get an id no query has."""
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
