"""The contract as code: validation, canonical operands and the abstract spec.

``canonicalize`` is called once per call (by the frontend, or by a platform entry point
used directly). It raises ``ValueError`` naming the argument and the value for bad
input, and returns the operands in canonical form together with an
:class:`AttentionSpec`, a hashable shape/dtype/feature record that platforms inspect
in ``supported(spec)`` and that travels as the static half of ``custom_vjp``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .mask import Band

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
FEATURES = ("causal", "window", "segment_ids", "bias", "mask", "soft_cap",
            "sinks", "dropout", "lse")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
  """Everything about a call except the array values."""

  batch: int
  seq_q: int
  seq_k: int
  heads_q: int
  heads_kv: int
  head_dim: int
  head_dim_v: int
  dtype: str
  softmax_scale: float
  band: Band
  causal: bool = False
  has_segment_ids: bool = False
  # The caller's promise that each segment id's positions form one run in q and
  # in kv (packed documents): kernels may mask by position spans instead.
  contiguous_segments: bool = False
  bias_shape: tuple[int, ...] | None = None  # rank 4, broadcastable
  mask_shape: tuple[int, ...] | None = None  # rank 4, broadcastable
  logits_soft_cap: float | None = None
  num_sinks: int = 0  # sinks are [heads_q, num_sinks]
  dropout_rate: float = 0.0
  return_lse: bool = False

  @property
  def group_size(self) -> int:
    return self.heads_q // self.heads_kv

  @property
  def features(self) -> frozenset[str]:
    used = set()
    if self.causal:
      used.add("causal")
    if self.band.left is not None or (self.band.right not in (None, 0)) or (
        self.band.right == 0 and not self.causal):
      used.add("window")
    for name, on in (("segment_ids", self.has_segment_ids),
                     ("bias", self.bias_shape is not None),
                     ("mask", self.mask_shape is not None),
                     ("soft_cap", self.logits_soft_cap is not None),
                     ("sinks", self.num_sinks > 0),
                     ("dropout", self.dropout_rate > 0),
                     ("lse", self.return_lse)):
      if on:
        used.add(name)
    return frozenset(used)


class Operands(NamedTuple):
  """Canonical arrays. Absent features are None (an empty pytree)."""

  q: Any  # [B, Sq, Hq, D]
  k: Any  # [B, Sk, Hkv, D]
  v: Any  # [B, Sk, Hkv, Dv]
  bias: Any = None  # rank 4, broadcastable to [B, Hq, Sq, Sk]
  mask: Any = None  # bool, rank 4, broadcastable to [B, Hq, Sq, Sk]
  q_segment_ids: Any = None  # int32 [B, Sq]
  kv_segment_ids: Any = None  # int32 [B, Sk]
  sinks: Any = None  # [Hq, n]
  dropout_seed: Any = None  # uint32 scalar


def shape_of(x, name):
  """``x.shape`` as a tuple; raises naming ``name`` when ``x`` is no array."""
  shape = getattr(x, "shape", None)
  if shape is None:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  return tuple(shape)


def _dtype_name(x) -> str:
  return jnp.dtype(x.dtype).name


def _broadcast_rank4(x, name, full, *, kind):
  shape = shape_of(x, name)
  if len(shape) > 4:
    raise ValueError(f"{name} must have rank <= 4 (broadcastable to "
                     f"[B, Hq, Sq, Sk] = {list(full)}), got shape {shape}")
  shape4 = (1,) * (4 - len(shape)) + shape
  for got, want in zip(shape4, full):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {shape} is not broadcastable to "
                       f"[B, Hq, Sq, Sk] = {list(full)}")
  if kind == "bool" and x.dtype != jnp.bool_:
    raise ValueError(f"{name} must be bool (True = attend), got dtype "
                     f"{_dtype_name(x)}")
  if kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating point, got dtype {_dtype_name(x)}")
  return jnp.reshape(x, shape4), shape4


def broadcast_rank4(x, name: str, full, *, kind: str):
  """``x`` validated as broadcastable to ``full`` (a bias: ``kind="float"``, a
  mask: ``kind="bool"``) and reshaped to rank 4; returns ``(x, shape4)``."""
  return _broadcast_rank4(x, name, full, kind=kind)


def parse_window(sliding_window, causal: bool) -> tuple[int | None, int | None]:
  """``(left, right)`` with None for unbounded; causal clamps right to 0."""
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a bool, got {causal!r}")
  causal = bool(causal)
  if sliding_window is None:
    left = right = None
  elif isinstance(sliding_window, numbers.Integral) and not isinstance(
      sliding_window, bool):
    w = int(sliding_window)
    if w < -1:
      raise ValueError(f"sliding_window must be >= 0 (or -1 for none), got {w}")
    left, right = (None, None) if w == -1 else (w, 0)
  elif isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2:
    bounds = []
    for side, w in zip(("left", "right"), sliding_window):
      if w is None:
        bounds.append(None)
        continue
      if not isinstance(w, numbers.Integral) or isinstance(w, bool) or w < -1:
        raise ValueError(f"sliding_window {side} bound must be an int >= -1 "
                         f"(-1 or None = unbounded), got {sliding_window!r}")
      bounds.append(None if w == -1 else int(w))
    left, right = bounds
  else:
    raise ValueError("sliding_window must be None, an int w (= (w, 0)) or a "
                     f"(left, right) pair, got {sliding_window!r}")
  if causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def static_number(x, name: str):
  """Raises ``ValueError`` when ``x`` is an array (a JAX array, traced or not, or
  a numpy array): ``name`` selects kernels and tiles at trace time, so it must be
  a Python (or numpy scalar) number."""
  if isinstance(x, (jax.Array, np.ndarray)) or (
      hasattr(x, "shape") and not isinstance(x, np.generic)):
    raise ValueError(f"{name} must be a Python number (static: it is fixed when the "
                     f"call is traced), got an array {getattr(x, 'dtype', '')}"
                     f"{list(getattr(x, 'shape', ()))}; pass float(x) outside jit")


def soft_cap(logits_soft_cap) -> float | None:
  """``logits_soft_cap`` as a float (None stays None); raises unless it is a
  finite positive static number."""
  if logits_soft_cap is None:
    return None
  static_number(logits_soft_cap, "logits_soft_cap")
  if (not isinstance(logits_soft_cap, numbers.Real) or isinstance(
      logits_soft_cap, bool) or not math.isfinite(logits_soft_cap)
      or logits_soft_cap <= 0):
    raise ValueError("logits_soft_cap must be None or a finite positive number, "
                     f"got {logits_soft_cap!r}")
  return float(logits_soft_cap)


def sinks_per_head(sinks, hq: int):
  """``(sinks [Hq, n], n)`` from sinks ``[Hq]`` or ``[Hq, n]``, or ``(None, 0)``;
  raises naming the shape or dtype that does not fit."""
  if sinks is None:
    return None, 0
  ss = shape_of(sinks, "sinks")
  if len(ss) not in (1, 2) or ss[0] != hq:
    raise ValueError(f"sinks must have shape [Hq] or [Hq, n] with Hq = {hq}, "
                     f"got {ss}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"sinks must be floating point, got dtype {_dtype_name(sinks)}")
  if len(ss) == 1:
    sinks = sinks[:, None]
  if sinks.shape[1] < 1:
    raise ValueError(f"sinks must have at least one sink per head, got {ss}")
  return sinks, sinks.shape[1]


def check_contiguous_segments(segment_ids):
  """Raises ``ValueError`` where concrete segment ids break the promise of
  ``contiguous_segments``: an id outside ``[-S, S)`` (``S`` its side's length)
  or whose positions in a row form more than one run. Traced ids (under
  ``jit``) and shapes alone cannot be checked here."""
  for name, ids in zip(("segment_ids[0] (q)", "segment_ids[1] (kv)"), segment_ids):
    if isinstance(ids, jax.core.Tracer) or not isinstance(ids, (jax.Array, np.ndarray)):
      continue
    x = np.asarray(ids)
    n = x.shape[-1]
    if x.size and (x.min() < -n or x.max() >= n):
      bad = x.min() if x.min() < -n else x.max()
      raise ValueError(f"contiguous_segments=True needs {name} in [-{n}, {n}) (its "
                       f"length), got id {bad}")
    for b, row in enumerate(x):
      starts = row[np.r_[True, row[1:] != row[:-1]]]
      values, counts = np.unique(starts, return_counts=True)
      if (counts > 1).any():
        raise ValueError(
            f"contiguous_segments=True, but {name} row {b} holds id "
            f"{values[counts > 1][0]} in {counts[counts > 1][0]} separate runs")


def int32_segment_ids(q_ids, kv_ids):
  """Segment ids as int32, equal exactly where the given ids are equal.

  Ids of one 32-bit-or-narrower dtype are cast (a bijection). Wider or mixed ids
  (int64 under ``jax_enable_x64``, where a cast would make 0 and 2**32 equal) are
  replaced by their rank among all ids of the call: equality and order are kept,
  and ranks fit int32 (a call has fewer than 2**31 ids)."""
  dq, dk = jnp.dtype(q_ids.dtype), jnp.dtype(kv_ids.dtype)
  if dq == dk and dq.itemsize <= 4:
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
  common = jnp.promote_types(dq, dk)
  if not jnp.issubdtype(common, jnp.integer):
    raise ValueError(f"segment_ids dtypes {dq.name} (q) and {dk.name} (kv) have no "
                     "common integer type; pass both as one dtype")
  q_ids, kv_ids = q_ids.astype(common), kv_ids.astype(common)
  ids = jnp.sort(jnp.concatenate([q_ids.ravel(), kv_ids.ravel()]))
  rank = lambda x: jnp.searchsorted(ids, x, side="left").astype(jnp.int32)
  return rank(q_ids), rank(kv_ids)


def canonicalize(q, k, v, *, bias=None, mask=None, causal=False,
                 sliding_window=None, segment_ids=None, softmax_scale=None,
                 logits_soft_cap=None, sinks=None, dropout_rate=0.0,
                 dropout_seed=None, return_lse=False, contiguous_segments=False):
  """Validates a call of the contract; returns ``(Operands, AttentionSpec)``."""
  qs, ks, vs = shape_of(q, "q"), shape_of(k, "k"), shape_of(v, "v")
  for name, s in (("q", qs), ("k", ks), ("v", vs)):
    if len(s) != 4:
      raise ValueError(f"{name} must have rank 4 [B, S, H, D], got shape {s}")
    if min(s) < 1:
      raise ValueError(f"{name} must have no zero-sized dimension, got shape {s}")
  b, sq, hq, d = qs
  if ks[0] != b or vs[0] != b:
    raise ValueError(f"batch sizes differ: q {qs}, k {ks}, v {vs}")
  if ks[1] != vs[1]:
    raise ValueError(f"k and v sequence lengths differ: k {ks}, v {vs}")
  if ks[2] != vs[2]:
    raise ValueError(f"k and v head counts differ: k {ks}, v {vs}")
  if ks[3] != d:
    raise ValueError(f"q and k head dims differ: q {qs}, k {ks}")
  sk, hkv, dv = ks[1], ks[2], vs[3]
  if hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads "
                     f"({hkv}) for MHA/GQA/MQA")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if _dtype_name(x) not in FLOAT_DTYPES:
      raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}, got "
                       f"{_dtype_name(x)}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError("q, k, v must share a dtype, got "
                     f"{_dtype_name(q)}, {_dtype_name(k)}, {_dtype_name(v)}")

  if softmax_scale is None:
    softmax_scale = 1.0 / math.sqrt(d)
  static_number(softmax_scale, "softmax_scale")
  if (not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)
      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
    raise ValueError("softmax_scale must be a finite positive number, got "
                     f"{softmax_scale!r}")
  left, right = parse_window(sliding_window, causal)
  causal = bool(causal)
  band = Band(seq_q=sq, seq_k=sk, left=left, right=right)

  full = (b, hq, sq, sk)
  bias_shape = mask_shape = None
  if bias is not None:
    bias, bias_shape = _broadcast_rank4(bias, "bias", full, kind="float")
  if mask is not None:
    mask, mask_shape = _broadcast_rank4(mask, "mask", full, kind="bool")

  q_ids = kv_ids = None
  if segment_ids is not None:
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
      raise ValueError("segment_ids must be a pair (q_ids [B, Sq], kv_ids [B, Sk]),"
                       f" got {type(segment_ids).__name__}")
    q_ids, kv_ids = segment_ids
    for name, ids, want in (("segment_ids[0] (q)", q_ids, (b, sq)),
                            ("segment_ids[1] (kv)", kv_ids, (b, sk))):
      if shape_of(ids, name) != want:
        raise ValueError(f"{name} must have shape {list(want)}, got "
                         f"{shape_of(ids, name)}")
      if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer, got dtype {_dtype_name(ids)}")
  if not isinstance(contiguous_segments, bool):
    raise ValueError(f"contiguous_segments must be a bool, got {contiguous_segments!r}")
  if contiguous_segments:
    if q_ids is None:
      raise ValueError("contiguous_segments=True needs segment_ids")
    check_contiguous_segments(segment_ids)
    # Within [-S, S) a cast keeps every id; ranking wide ids would spread them
    # past that range.
    q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
  elif q_ids is not None:
    q_ids, kv_ids = int32_segment_ids(q_ids, kv_ids)

  logits_soft_cap = soft_cap(logits_soft_cap)
  sinks, num_sinks = sinks_per_head(sinks, hq)

  static_number(dropout_rate, "dropout_rate")
  if (not isinstance(dropout_rate, numbers.Real) or isinstance(dropout_rate, bool)
      or not 0.0 <= dropout_rate < 1.0):
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
  dropout_rate = float(dropout_rate)
  if dropout_rate > 0:
    if dropout_seed is None:
      raise ValueError("dropout_seed is required when dropout_rate > 0 "
                       f"(dropout_rate={dropout_rate})")
    if isinstance(dropout_seed, numbers.Integral) and not isinstance(
        dropout_seed, bool):
      seed = jnp.uint32(int(dropout_seed) & 0xFFFFFFFF)
    else:
      seed = dropout_seed
      if (shape_of(seed, "dropout_seed") != () or
          not jnp.issubdtype(seed.dtype, jnp.integer)):
        raise ValueError("dropout_seed must be an integer scalar, got "
                         f"{dropout_seed!r}")
      if seed.dtype == jnp.int32:
        seed = jax.lax.bitcast_convert_type(seed, jnp.uint32)
      elif seed.dtype != jnp.uint32:
        seed = seed.astype(jnp.uint32)
    dropout_seed = seed
  else:
    dropout_seed = None

  if not isinstance(return_lse, bool):
    raise ValueError(f"return_lse must be a bool, got {return_lse!r}")

  spec = AttentionSpec(
      batch=b, seq_q=sq, seq_k=sk, heads_q=hq, heads_kv=hkv, head_dim=d,
      head_dim_v=dv, dtype=_dtype_name(q), softmax_scale=float(softmax_scale),
      band=band, causal=causal, has_segment_ids=q_ids is not None,
      contiguous_segments=contiguous_segments,
      bias_shape=bias_shape, mask_shape=mask_shape,
      logits_soft_cap=logits_soft_cap, num_sinks=num_sinks,
      dropout_rate=dropout_rate, return_lse=return_lse)
  ops = Operands(q, k, v, bias, mask, q_ids, kv_ids, sinks, dropout_seed)
  return ops, spec


def abstract_spec(*, batch, seq_q, seq_k, heads_q, head_dim, heads_kv=None,
                  head_dim_v=None, dtype="bfloat16", **features) -> AttentionSpec:
  """An :class:`AttentionSpec` from sizes alone (for ``supported`` queries,
  benchmarks and tuning), validated by the same code as real calls. Array-valued
  features (bias, mask, segment_ids, sinks) may be ``jax.ShapeDtypeStruct``."""
  sd = jax.ShapeDtypeStruct
  q = sd((batch, seq_q, heads_q, head_dim), dtype)
  k = sd((batch, seq_k, heads_kv or heads_q, head_dim), dtype)
  v = sd((batch, seq_k, heads_kv or heads_q, head_dim_v or head_dim), dtype)
  if features.get("dropout_rate") and features.get("dropout_seed") is None:
    features["dropout_seed"] = sd((), jnp.uint32)
  is_array = lambda x: hasattr(x, "shape") or isinstance(x, (tuple, list)) and all(
      hasattr(y, "shape") for y in x)
  arrays = {n: x for n, x in features.items() if is_array(x)}
  static = {n: x for n, x in features.items() if n not in arrays}
  box = []

  def trace(q, k, v, arrays):
    box.append(canonicalize(q, k, v, **arrays, **static)[1])

  jax.eval_shape(trace, q, k, v, arrays)
  return box[0]
