"""Counter-based dropout keep-mask: a pure function of (seed, b, h, i, j).

Every platform must compute it bit-identically, so it uses only uint32 wrap-around
multiplication, xor and logical shifts, which XLA, Pallas (TPU and GPU) and Triton
all provide with the same semantics. No RNG state: the backward recomputes the same
mask from the same coordinates, and the reference reproduces a kernel exactly.

The row key of (seed, b, h, i) folds the coordinates in one at a time, each scaled
by an odd constant first so that neighbouring indices land far apart, through the
32-bit finaliser of MurmurHash3 (a bijection with full avalanche). ``b`` is the
global batch index, ``h`` the global *query* head index, ``i``/``j`` the
query/key positions.

Each element then mixes its row key with its key's term by two multiply-xorshift
rounds (:func:`mix_element`) rather than a fourth finaliser: the row key is already
random, and the kernels hash once per element, where the integer work bounds a
Hopper forward's speed: on an H200 (2026-11-27) the Mosaic forward with dropout ran
1.23-1.25x faster than with the finaliser per element, the triton one 1.17-1.28x
(docs/reports/2026-11-27-h200-dropout-element-mix.md). Two
rounds keep the statistics of the full finaliser (keep rate, neighbour and
rectangle correlations, row and column sum variances on 2048 x 2048 masks); one
round did not (column pairs correlated at 13 sigma; common/tests/dropout_test.py).
The row key and key term meet by xor, not by an add: an add would let the first
product be folded into both terms (one operation per element fewer), but two
rows would then differ by a constant before the element's only nonlinear step,
and rows whose keys lie close correlate (row pairs up to 0.26 on a 2048 x 2048
mask, against 0.11-0.12 for independent draws; CPU, 2026-11-29).

The keep test compares the top 24 bits of the hash with a 24-bit threshold: both
are below 2**24, so a backend that compares 32-bit integers as signed (Triton's
lowering may) decides exactly as one that compares them as unsigned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_FMIX_1 = 0x85EBCA6B
_FMIX_2 = 0xC2B2AE35
# Odd multipliers (golden-ratio and xxHash primes) per coordinate.
_K_BATCH = 0x9E3779B1
_K_HEAD = 0x85EBCA77
_K_ROW = 0xC2B2AE3D
_K_COL = 0x27D4EB2F


def _u32(x):
  x = jnp.asarray(x)
  if x.dtype == jnp.uint32:
    return x
  if x.dtype == jnp.int32:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return x.astype(jnp.uint32)


def fmix32(x):
  x = x ^ (x >> 16)
  x = x * jnp.uint32(_FMIX_1)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(_FMIX_2)
  return x ^ (x >> 16)


_MIX_1 = 0x9E3779B1
_MIX_2 = 0xC2B2AE35


def mix_element(x):
  """Two multiply-xorshift rounds on uint32 ``row ^ col``; the keep test reads
  the top 24 bits, which both products fill from every bit below."""
  x = x * jnp.uint32(_MIX_1)
  x = x ^ (x >> 15)
  return x * jnp.uint32(_MIX_2)


def row_key(seed, b, h, i):
  """uint32 key of one query row; broadcasts over its arguments."""
  x = fmix32(_u32(seed) ^ (_u32(b) * jnp.uint32(_K_BATCH)))
  x = fmix32(x ^ (_u32(h) * jnp.uint32(_K_HEAD)))
  return fmix32(x ^ (_u32(i) * jnp.uint32(_K_ROW)))


def threshold(rate: float) -> int:
  """Top-24-bit values below this are dropped: P(drop) = threshold / 2**24."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate!r}")
  return min(int(round(rate * 2.0**24)), 2**24 - 1)


def keep_scale(rate: float) -> float:
  """``1 / (1 - rate)``: what a kept probability is multiplied by, so that the
  output's expectation is the one without dropout."""
  return 1.0 / (1.0 - rate)


def col_key(j):
  """uint32 term of key position ``j``; a kernel whose tile's keys are fixed
  computes it once per key, not per element."""
  return _u32(j) * jnp.uint32(_K_COL)


def keep_from_keys(row, col, rate: float, unsigned_compare: bool = False):
  """Keep-mask for row keys ``row`` (:func:`row_key`) and key terms ``col``
  (:func:`col_key`), broadcast against each other. ``unsigned_compare``: the
  same decision as ``bits >= threshold * 2**8`` on the whole uint32, one shift
  fewer per element, for a backend known to compare uint32 unsigned (Mosaic-GPU,
  where the hash bounds the kernel's speed)."""
  bits = mix_element(row ^ col)
  if unsigned_compare:
    return bits >= jnp.uint32(threshold(rate) << 8)
  top = jax.lax.bitcast_convert_type(bits >> 8, jnp.int32)
  return top >= jnp.int32(threshold(rate))


def keep_from_row_key(key, j, rate: float):
  """Keep-mask for row keys ``key`` and key positions ``j`` (broadcast)."""
  return keep_from_keys(key, col_key(j), rate)


def keep(seed, b, h, i, j, rate: float):
  """True where the probability at (b, h, i, j) survives dropout."""
  return keep_from_row_key(row_key(seed, b, h, i), j, rate)


def shard_seed(seed, batch_offset, head_offset):
  """The seed one shard of a split call hands its kernels: ``uint32 [3]`` of the
  call's seed and the shard's first global batch and query-head index, so the
  kernels hash global coordinates from local program ids."""
  return jnp.stack([_u32(seed).reshape(()), _u32(batch_offset), _u32(head_offset)])


def position_seed(seed, batch_offset, head_offset, q_offset, k_offset):
  """``uint32 [5]``: the call's seed and the global index of a block's first batch
  element, query head, query row and key, for a call on one block of a larger
  problem (a hop of ring attention), so its keep-mask is the larger call's."""
  return jnp.stack([_u32(seed).reshape(())] + [
      _u32(x).reshape(()) for x in (batch_offset, head_offset, q_offset, k_offset)])


def unpack_seed(seed):
  """``(seed, batch, head, row, key)`` offsets of a scalar seed (offsets 0), a
  ``shard_seed`` or a ``position_seed``."""
  seed = _u32(seed)
  if seed.ndim == 0:
    return seed, 0, 0, 0, 0
  parts = [seed[n] for n in range(seed.shape[0])]
  return tuple(parts + [0] * (5 - len(parts)))


def kernel_seed(dropout_seed, positions: bool = False):
  """``int32`` words a kernel reads: seed, batch offset, head offset, then (with
  ``positions``) row and key offsets, zero-padded to 4 (8 with ``positions``:
  GPU Pallas blocks must be powers of two). Takes the call's scalar seed (offsets
  0), a ``shard_seed``, or with ``positions`` also a ``position_seed``. A kernel
  adds the offsets to its local indices and hashes with :func:`row_key` and
  :func:`keep_from_row_key`."""
  if not positions and jnp.ndim(dropout_seed) == 1 and dropout_seed.shape[0] > 3:
    raise NotImplementedError(
        "dropout with sequence offsets (a position_seed, as ring attention passes "
        "per hop) needs a reader of the row and key offsets: "
        "kernel_seed(..., positions=True)")
  x = jax.lax.bitcast_convert_type(_u32(dropout_seed), jnp.int32).reshape(-1)
  size = 8 if positions else 4
  return jnp.pad(x, (0, size - x.shape[0]))


def keep_numpy(seed: int, b, h, i, j, rate: float) -> np.ndarray:
  """The same function in NumPy, for tests that must not trust JAX's version."""
  def mix(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_FMIX_1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(_FMIX_2)
    return x ^ (x >> np.uint32(16))

  def element(x):
    x = x * np.uint32(_MIX_1)
    x = x ^ (x >> np.uint32(15))
    return x * np.uint32(_MIX_2)

  u = lambda a: np.asarray(a).astype(np.uint32)
  with np.errstate(over="ignore"):
    x = mix(np.uint32(seed & 0xFFFFFFFF) ^ (u(b) * np.uint32(_K_BATCH)))
    x = mix(x ^ (u(h) * np.uint32(_K_HEAD)))
    x = mix(x ^ (u(i) * np.uint32(_K_ROW)))
    bits = element(x ^ (u(j) * np.uint32(_K_COL)))
  return (bits >> np.uint32(8)).astype(np.int64) >= threshold(rate)
