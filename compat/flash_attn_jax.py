"""flash-attn-jax's and flash-attn3-jax's entries: ``flash_mha`` and
``flash_mha_varlen`` with their shapes and meaning, translated into the contract
(varlen sequences become segment ids; no ``[S, S]`` mask is built)."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from .. import api


def _concrete(*xs) -> bool:
  """Whether none of ``xs`` is traced (None counts as concrete): such offsets
  can be read on the host."""
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _window_pair(window_size) -> tuple:
  """flash-attn's ``window_size``: a ``(left, right)`` pair, -1 = unbounded."""
  if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
    raise ValueError("window_size must be a (left, right) pair of ints (-1 = "
                     f"unbounded), got {window_size!r}")
  return tuple(window_size)


def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
  """flash-attn-jax's entry: ``[B, S, H, D]``, ``window_size=(left, right)``."""
  return api.flash_attention(q, k, v, softmax_scale=softmax_scale, causal=is_causal,
                             sliding_window=_window_pair(window_size))


# Up to this many inner offsets a row's sequence is one compare and sum, rows x
# offsets work that XLA fuses into the kernels using the ids; past it, a scatter
# and a prefix sum, O(rows) but five kernels (a fill, the scatter and three
# reduce-windows). On an H200 (2026-11-27, 16k tokens of 8, 9 and 32 sequences)
# the compare made the varlen forward 1.011-1.080x faster; the bound of 128 is
# not measured (the compare's work grows with it).
COMPARE_OFFSETS = 128


def _rows(cu, total, used=None, xp=jnp):
  """Each packed row's sequence, and whether it is a real row: before the last
  offset and, with ``used`` (flash-attn3's ``seqused_k``), among the first
  ``used[s]`` rows of its sequence. ``xp=np`` computes them on the host, from
  concrete offsets."""
  rows = xp.arange(total)
  # A row's sequence is the number of inner offsets at or before it.
  # (jnp.searchsorted's default scan is a loop that an H200 ran as a while loop
  # with a host round trip per step: 40 us of a 0.35 ms varlen forward, 8 x 2048
  # causal, 2026-11-24.)
  inner = cu[1:-1]
  if xp is np:
    s = np.searchsorted(inner, rows, side="right")
  elif inner.shape[0] <= COMPARE_OFFSETS:
    s = jnp.sum(inner[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)
  else:
    starts = jnp.zeros((total,), jnp.int32).at[inner].add(1, mode="drop")
    s = jnp.cumsum(starts)
  s = xp.clip(s, 0, cu.shape[0] - 2)
  real = rows < cu[-1]
  if used is not None and used.shape[0]:  # no sequences: no real row to index
    real &= rows - cu[s] < used[s]
  return rows, s, real


def _cu_to_ids(cu, total, pad_id, used=None):
  """Each packed row's sequence number, ``pad_id`` on padding and unused rows.
  From concrete offsets the ids are computed on the host: an eager call then
  neither runs a dozen small device computations for them nor waits for the
  ids' copy back when the promise of contiguous segments is checked."""
  concrete = _concrete(cu, used)
  xp = np if concrete else jnp
  if concrete:
    cu, used = np.asarray(cu), None if used is None else np.asarray(used)
  _, s, real = _rows(cu, total, used, xp)
  return xp.where(real, s.astype(np.int32), np.int32(pad_id))


def _end_aligned_layout(cu_q, cu_k, total_q, total_k, used_k=None):
  """Positions of packed q and k rows in a layout where sequence ``s`` occupies a
  slot of ``max(len_q, len_k)`` and both its q and its k rows end at the slot's
  end. In that layout one causal/window band with offset 0 (plus segment ids) is
  each sequence's own bottom-right aligned band: key j of s is visible to query i
  of s iff ``j <= i + len_k - len_q`` iff ``pos_k <= pos_q``. The layout has
  ``total_q + total_k`` rows, a bound on the sum of slots known at trace time.
  With ``used_k`` a sequence's keys are its first ``used_k[s]`` rows."""
  len_q = jnp.diff(cu_q)
  len_k = jnp.diff(cu_k) if used_k is None else used_k
  slot_end = jnp.cumsum(jnp.maximum(len_q, len_k))

  def positions(cu, lens, total, used):
    rows, s, real = _rows(cu, total, used)
    # Padding and unused rows park past every slot, each on a row of its own.
    spare = jnp.cumsum(~real) - 1
    return jnp.where(real, slot_end[s] - lens[s] + rows - cu[s], slot_end[-1] + spare)

  return (positions(cu_q, len_q, total_q, None),
          positions(cu_k, len_k, total_k, used_k))


def _q_on_key_rows(cu_q, cu_k, total_q, total_k, used_k=None):
  """Rows of the packed keys that take the packed q rows: sequence ``s``'s
  queries take the last ``len_q[s]`` of its key rows, so one band with offset 0
  (plus segment ids) is each sequence's own bottom-right band while K and V stay
  where they are. Padding q rows, and the first ``len_q[s] - len_k[s]`` queries
  of a sequence with more queries than (used) keys, which would land before its
  keys, map to ``total_k`` (out of range: dropped, output 0). Those queries see
  no key under a band that ends on the diagonal (causal), which alone may take
  this layout when some sequence has more queries than keys."""
  len_q = jnp.diff(cu_q)
  len_k = jnp.diff(cu_k) if used_k is None else used_k
  rows, s, real = _rows(cu_q, total_q)
  early = len_q[s] - len_k[s] > rows - cu_q[s]
  return jnp.where(real & ~early, cu_k[s] + len_k[s] - len_q[s] + rows - cu_q[s],
                   total_k)


def _queries_fit_keys(cu_q, cu_k, used_k=None, xp=jnp):
  len_k = xp.diff(cu_k) if used_k is None else used_k
  return xp.all(xp.diff(cu_q) <= len_k)


def _check_offsets(name, cu, total):
  """``ValueError`` unless concrete offsets ``cu`` start at 0, never decrease and
  end at most at ``total``; traced offsets pass unchecked (see flash_mha_varlen)."""
  if not _concrete(cu):
    return
  offsets = np.asarray(cu)
  if offsets.size == 0 or offsets[0] != 0:
    raise ValueError(f"{name} must start at 0, got {offsets.tolist()}")
  if np.any(np.diff(offsets) < 0):
    raise ValueError(f"{name} must be non-decreasing, got {offsets.tolist()}")
  if offsets[-1] > total:
    raise ValueError(f"{name} ends at {int(offsets[-1])}, past the {total} packed "
                     f"rows: {offsets.tolist()}")


def _check_used(seqused_k, cu_k):
  """``ValueError`` unless ``seqused_k`` is a 1-D int array with one count per
  sequence; concrete counts must lie in ``[0, len_k]``."""
  n = cu_k.shape[0] - 1
  if getattr(seqused_k, "shape", None) != (n,) or not jnp.issubdtype(
      seqused_k.dtype, jnp.integer):
    raise ValueError(f"seqused_k must be a 1-D int array of {n} key counts (one per "
                     f"sequence), got {getattr(seqused_k, 'shape', seqused_k)}")
  if not _concrete(seqused_k, cu_k):
    return
  used, lens = np.asarray(seqused_k), np.diff(np.asarray(cu_k))
  if np.any(used < 0) or np.any(used > lens):
    raise ValueError(f"seqused_k must lie between 0 and each sequence's keys "
                     f"{lens.tolist()}, got {used.tolist()}")


def flash_mha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale=None, is_causal=False,
                     window_size=(-1, -1), *, seqused_k=None):
  """flash-attn3-jax's varlen entry on packed ``[total, H, D]`` inputs.

  Sequence ``s`` is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and
  ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k/v; positions past the last offset are
  padding (output 0). Lowered to segment ids (no ``[S, S]`` mask). Causal and
  window bands are aligned bottom-right per sequence, as in FlashAttention: with
  different q and k lengths, query i of a sequence sees key j iff
  ``j <= i + len_k - len_q`` (and ``j >= i + len_k - len_q - left``). With equal
  offsets (the same array, equal values, or under ``jit`` equal at run time, a
  ``lax.cond``) this runs on the packed rows directly. Where offsets differ but no
  sequence has more queries than keys (prefill after a cached prefix, cross
  attention to longer contexts), the q rows move onto the ends of their
  sequences' key rows and K and V are not copied. So do they under a band that
  ends on the diagonal (causal, or a window ``(left, 0)``) when a sequence has
  more queries than keys: its first ``len_q - len_k`` queries see no key (output
  0). Otherwise (a window reaching past the diagonal, ``right > 0`` or -1, and
  some sequence with more queries than keys) q, k and v move to an end-aligned
  layout of ``total_q + total_k`` rows first (more work, same result).

  ``seqused_k`` (flash-attn3-jax's keyword): int ``[num_sequences]``; sequence
  ``s`` then has keys ``cu_seqlens_k[s] : cu_seqlens_k[s] + seqused_k[s]`` only
  (its other k/v rows are ignored), and its band is aligned to that length.

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
  if seqused_k is not None:
    _check_used(seqused_k, cu_seqlens_k)
  window_size = _window_pair(window_size)
  banded = is_causal or tuple(window_size) != (-1, -1)
  # Under a band that ends on the diagonal the queries that find no key rows of
  # their sequence (more queries than keys) see no key: every offsets array
  # fits the key rows, with no layout of total_q + total_k rows and, under jit,
  # no lax.cond (whose predicate a GPU hands to the host first).
  on_diagonal = is_causal or window_size[1] == 0
  attend = lambda q, k, v, q_ids, kv_ids, runs=False: api.flash_attention(
      q[None], k[None], v[None], softmax_scale=softmax_scale, causal=is_causal,
      sliding_window=tuple(window_size), segment_ids=(q_ids[None], kv_ids[None]),
      contiguous_segments=runs)[0]

  def packed(q, k, v):
    # Sequences one after another, then a padding id: each id one run, unless
    # seqused_k leaves unused key rows inside sequences; the ids (sequence
    # numbers, -1 and -2) lie within each side's length unless there are more
    # sequences than rows (empty sequences).
    runs = (seqused_k is None and
            cu_seqlens_q.shape[0] - 1 <= min(q.shape[0], k.shape[0]) and
            min(q.shape[0], k.shape[0]) >= 2)
    return attend(q, k, v, _cu_to_ids(cu_seqlens_q, q.shape[0], -1),
                  _cu_to_ids(cu_seqlens_k, k.shape[0], -2, seqused_k), runs)

  def end_aligned(q, k, v):
    pos_q, pos_k = _end_aligned_layout(cu_seqlens_q, cu_seqlens_k, q.shape[0],
                                       k.shape[0], seqused_k)
    rows = q.shape[0] + k.shape[0]
    place = lambda x, pos: jnp.zeros((rows,) + x.shape[1:], x.dtype).at[pos].set(
        x, unique_indices=True)
    # Ids: the sequence on its rows, -1 / -2 on q / k filler and padding rows
    # (never equal, so those rows attend to nothing and output 0).
    q_ids = jnp.full((rows,), -1, jnp.int32).at[pos_q].set(
        _cu_to_ids(cu_seqlens_q, q.shape[0], -1))
    kv_ids = jnp.full((rows,), -2, jnp.int32).at[pos_k].set(
        _cu_to_ids(cu_seqlens_k, k.shape[0], -2, seqused_k))
    return attend(place(q, pos_q), place(k, pos_k), place(v, pos_k), q_ids,
                  kv_ids)[pos_q]

  def on_key_rows(q, k, v):
    rows = k.shape[0]
    pos = _q_on_key_rows(cu_seqlens_q, cu_seqlens_k, q.shape[0], rows, seqused_k)
    # Not unique: every padding row maps to the same dropped index.
    placed = jnp.zeros((rows,) + q.shape[1:], q.dtype).at[pos].set(q, mode="drop")
    q_ids = jnp.full((rows,), -1, jnp.int32).at[pos].set(
        _cu_to_ids(cu_seqlens_q, q.shape[0], -1), mode="drop")
    out = attend(placed, k, v, q_ids,
                 _cu_to_ids(cu_seqlens_k, rows, -2, seqused_k))
    # Padding q rows read past the end: 0, as on the packed rows.
    return jnp.take(out, pos, axis=0, mode="fill", fill_value=0)

  # The packed rows serve directly unless a band meets sequences whose q and k
  # offsets differ (bottom-right alignment per sequence then needs the q rows
  # moved onto their keys, or every row moved where some q is longer than its k).
  if not banded or cu_seqlens_q is cu_seqlens_k and seqused_k is None:
    return packed(q, k, v)
  offsets = (cu_seqlens_q, cu_seqlens_k) + (() if seqused_k is None else (seqused_k,))
  if _concrete(*offsets):
    if (q.shape[0] == k.shape[0] and seqused_k is None and
        np.array_equal(np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k))):
      return packed(q, k, v)
    # numpy: under an outer jit jnp would stage even these concrete values.
    fits = on_diagonal or bool(_queries_fit_keys(*(np.asarray(x) for x in offsets),
                                                 xp=np))
    return on_key_rows(q, k, v) if fits else end_aligned(q, k, v)
  # Offsets known only when the program runs (under jit): chosen then.
  moved = on_key_rows if on_diagonal else lambda q, k, v: jax.lax.cond(
      _queries_fit_keys(cu_seqlens_q, cu_seqlens_k, seqused_k), on_key_rows,
      end_aligned, q, k, v)
  if q.shape[0] != k.shape[0] or seqused_k is not None:
    return moved(q, k, v)
  # Equal offsets, the usual self-attention over packed documents, take the
  # packed rows.
  return jax.lax.cond(jnp.array_equal(cu_seqlens_q, cu_seqlens_k), packed, moved,
                      q, k, v)
