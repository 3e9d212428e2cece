"""``jax.nn.dot_product_attention``'s signature and meaning on flashjax's platforms.

jax.nn aligns ``is_causal`` and ``local_window_size`` top-left (query ``i`` sees
key ``j`` iff ``i - left <= j <= i + right``, causal meaning ``right = 0``), while
the flashjax contract aligns its band bottom-right (on the diagonal
``j = i + Sk - Sq``). The two agree when ``Sq == Sk``. Otherwise the call is
translated exactly: keys that no query can reach and queries that reach no key are
cut off first (their outputs are 0 and their gradients 0 either way), which leaves
a band whose bottom-right bounds are non-negative, as the contract requires.
Sequence lengths become segment ids, so no ``[Sq, Sk]`` mask is built.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax
import jax.numpy as jnp

from .. import api
from ..common import spec as spec_lib

_JAX_NN_ONLY = ("cudnn",)


def _window(local_window_size, is_causal):
  """Top-left ``(left, right)``; None for an unbounded side."""
  if local_window_size is None:
    left = right = None
  elif isinstance(local_window_size, numbers.Integral) and not isinstance(
      local_window_size, bool):
    if local_window_size < 0:
      raise ValueError("local_window_size must be >= 0, got "
                       f"{local_window_size!r}")
    left = right = int(local_window_size)
  elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
    for w in local_window_size:
      if not isinstance(w, numbers.Integral) or isinstance(w, bool) or w < 0:
        raise ValueError("local_window_size must be an int >= 0 or a (left, "
                         f"right) pair of them, got {local_window_size!r}")
    left, right = (int(w) for w in local_window_size)
  else:
    raise ValueError("local_window_size must be None, an int or a (left, right) "
                     f"pair, got {local_window_size!r}")
  if not isinstance(is_causal, bool):
    raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def _ensure_4d(x, name):
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank 3 or 4, got shape {x.shape}")
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _cut(x, axis, n):
  """First ``n`` entries along ``axis``, unless that axis is broadcast (size 1)."""
  if x is None or x.shape[axis] == 1 or x.shape[axis] == n:
    return x
  return jax.lax.slice_in_dim(x, 0, n, axis=axis)


def _lengths_to_ids(lengths, size, batch, name):
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{name} must be an int array of shape ({batch},), got "
                     f"{lengths.dtype} {lengths.shape}")
  return jnp.arange(size)[None, :] < lengths[:, None]


def _platforms(implementation):
  if implementation is None or isinstance(implementation, str):
    names = [implementation]
  elif isinstance(implementation, Sequence) and implementation and all(
      isinstance(n, str) for n in implementation):
    names = list(implementation)
  else:
    raise ValueError("implementation must be None, a platform name or a non-empty "
                     f"list of them, got {implementation!r}")
  for n in names:
    if n in _JAX_NN_ONLY:
      raise ValueError(f"implementation {n!r} is jax.nn's own kernel; flashjax runs"
                       " 'xla', 'pallas', 'pallas-triton' or 'triton' (or None for "
                       "the automatic choice)")
  return names


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False,
                          logits_soft_cap=None, sinks=None, segment_ids=None,
                          dropout_rate=0.0, dropout_seed=None, return_lse=False,
                          backend=None, config=None, interpret=False):
  """``jax.nn.dot_product_attention`` with flashjax's kernels.

  Args:
    query: ``[B, T, N, H]`` or ``[T, N, H]``.
    key, value: ``[B, S, K, H]`` or ``[S, K, H]``, ``N % K == 0`` (GQA/MQA).
    bias: additive, broadcastable to ``[B, N, T, S]`` (or ``[N, T, S]``).
    mask: bool, broadcastable likewise; True = attend.
    scale: logit scale; default ``1/sqrt(H)``.
    is_causal: query ``i`` sees key ``j`` iff ``j <= i`` (top-left, as jax.nn).
    query_seq_lengths: int ``[B]``; query rows at or past it are padding (output 0).
    key_value_seq_lengths: int ``[B]``; keys at or past it are padding.
    local_window_size: ``(left, right)``: query ``i`` sees keys
      ``i - left .. i + right``; an int ``w`` means ``(w, w)``.
    implementation: None (automatic), a flashjax platform name ("xla", "pallas",
      "pallas-triton", "triton") or an ordered list of them, tried in turn.
    return_residual: also return the lse ``[B, T, N]`` (jax.nn's residual).
    logits_soft_cap, sinks, segment_ids, dropout_rate, dropout_seed: as in
      :func:`flashjax.flash_attention`.
    return_lse: also return the lse in flashjax's layout ``[B, N, T]``.
    backend, config, interpret: as in :func:`flashjax.flash_attention`.

  Returns:
    The output with ``query``'s shape; with ``return_residual`` or ``return_lse``
    a pair ``(out, lse)``. Rows that see no key give 0 (jax.nn's XLA path gives
    the mean of the values there, an artifact of its finite mask value).
  """
  names = _platforms(implementation)
  q_rank = jnp.ndim(query)
  if q_rank not in (3, 4):
    raise ValueError(f"query must have rank 3 or 4, got shape {jnp.shape(query)}")
  q, k, v = (_ensure_4d(x, n) for x, n in ((query, "query"), (key, "key"),
                                            (value, "value")))
  bias, mask = _ensure_4d(bias, "bias"), _ensure_4d(mask, "mask")
  b, t = q.shape[0], q.shape[1]
  s = k.shape[1]
  left, right = _window(local_window_size, is_causal)

  # Cut keys past the last one a query can reach, and queries past the last one
  # that reaches a key: what remains has Sk' - Sq' <= right and Sq' - Sk' <= left.
  s_cut = s if right is None else min(s, t + right)
  t_cut = t if left is None else min(t, s_cut + left)
  if (t_cut, s_cut) != (t, s):
    q = q[:, :t_cut]
    k, v = k[:, :s_cut], v[:, :s_cut]
    bias, mask = (_cut(_cut(x, 2, t_cut), 3, s_cut) for x in (bias, mask))
  offset = s_cut - t_cut
  window = (None if left is None else left + offset,
            None if right is None else right - offset)

  q_real = kv_real = None
  if query_seq_lengths is not None:
    q_real = _lengths_to_ids(query_seq_lengths, t, b, "query_seq_lengths")[:, :t_cut]
  if key_value_seq_lengths is not None:
    kv_real = _lengths_to_ids(key_value_seq_lengths, s, b,
                              "key_value_seq_lengths")[:, :s_cut]
  if q_real is not None or kv_real is not None:
    if segment_ids is None:
      q_ids = jnp.zeros((b, t_cut), jnp.int32)
      kv_ids = jnp.zeros((b, s_cut), jnp.int32)
    else:
      q_ids, kv_ids = spec_lib.int32_segment_ids(*(jnp.asarray(x)
                                                    for x in segment_ids))
      q_ids, kv_ids = q_ids[:, :t_cut], kv_ids[:, :s_cut]
    # Padding gets ids below every real one, different on the two sides (int32
    # ids: below INT32_MIN + 2 they would wrap; a call has far fewer ids).
    low = jnp.minimum(jnp.min(q_ids), jnp.min(kv_ids))
    if q_real is not None:
      q_ids = jnp.where(q_real, q_ids, low - 1)
    if kv_real is not None:
      kv_ids = jnp.where(kv_real, kv_ids, low - 2)
    segment_ids = (q_ids, kv_ids)
  elif segment_ids is not None and (t_cut, s_cut) != (t, s):
    segment_ids = (segment_ids[0][:, :t_cut], segment_ids[1][:, :s_cut])

  reasons = []
  for name in names:
    try:
      out, lse = api.flash_attention(
          q, k, v, bias=bias, mask=mask, sliding_window=window,
          segment_ids=segment_ids, softmax_scale=scale,
          logits_soft_cap=logits_soft_cap, sinks=sinks, dropout_rate=dropout_rate,
          dropout_seed=dropout_seed, return_lse=True, backend=backend,
          platform=name, config=config, interpret=interpret)
      break
    except NotImplementedError as e:
      if len(names) == 1:
        raise
      reasons.append(f"{name}: {e}")
  else:
    raise NotImplementedError("no implementation in the list can run this call:\n  "
                              + "\n  ".join(reasons))
  if t_cut < t:
    out = jnp.pad(out, ((0, 0), (0, t - t_cut), (0, 0), (0, 0)))
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, t - t_cut)), constant_values=-jnp.inf)
  if q_rank == 3:
    out, lse = out[0], lse[0]
  if return_residual:
    return out, jnp.swapaxes(lse, -1, -2)
  return (out, lse) if return_lse else out
