"""The Pallas-Triton forward's last wave, split along the keys.

A non-causal forward launches one program per (q block, batch, head), all of the
same length. With ``N`` programs and ``S`` of them running at once (one per SM
for the long-key D = 128 tiles), the last ``N mod S`` programs form a partial
wave that takes as long as a full one while most SMs idle: at B2 S8k H16 that is
68 of 2048 programs on 132 SMs, the 16th wave of a 15.5-wave launch.

Here the launch is one-dimensional: the first ``N - T`` units are whole programs
in the 3-D grid's order, and each of the last ``T`` programs runs as ``k`` units
over consecutive key ranges. A part writes its unnormalised output, row max and
row sum (fp32); a second small kernel combines the ``k`` parts of each tail
block as the online softmax would and writes the block's output and lse in
place. ``k`` is the split that minimises the modelled time of the tail,
``ceil(T k / S)`` rounds of ``1 / k + overhead`` program-times each, and no split
is made where none beats a plain wave.

The Mosaic-GPU persistent forward (mosaic/fwd.py) uses the same plan and this
combine kernel for its last round of tiles; its parts store the normalised output
(as a high and a low half in the input dtype) and ``m`` = lse in log2 units, with
no ``l``: the same weights merge them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..common.blocking import LN2

# Per part, in program-times: loading q, filling the pipeline, writing the fp32
# partials.
PART_OVERHEAD = 0.03
MAX_PARTS = 8


@dataclasses.dataclass(frozen=True)
class Tail:
  full: int  # programs run whole: the launch's first units
  count: int  # the last programs, run in parts
  parts: int

  @property
  def units(self) -> int:
    return self.full + self.count * self.parts


def plan(programs: int, slots: int, kv_blocks: int) -> Tail | None:
  """The split of a launch of ``programs`` equal programs of ``kv_blocks`` key
  tiles each, ``slots`` at a time; None where splitting would not pay."""
  if slots <= 0 or programs < 2 * slots:
    return None
  count = programs % slots
  if count == 0:
    return None
  best, best_cost = 1, 1.0
  for k in range(2, min(MAX_PARTS, kv_blocks) + 1):
    cost = -(-count * k // slots) * (1.0 / k + PART_OVERHEAD)
    if cost < best_cost - 1e-9:
      best, best_cost = k, cost
  return None if best == 1 else Tail(programs - count, count, best)


# Every operand below is >= 0, so truncating lax.div / lax.rem equal floor
# division: plain scalar ops that both Pallas-Triton and Mosaic-GPU lower.
def _div(a, b):
  return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _rem(a, b):
  return lax.rem(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def unit(tail: Tail, t):
  """Unit ``t`` -> (whole?, program, part); traced int32 in, traced out."""
  whole = t < tail.full
  rest = jnp.maximum(t - tail.full, 0)
  program = jnp.where(whole, t, tail.full + _div(rest, tail.parts))
  return whole, program, jnp.where(whole, 0, _rem(rest, tail.parts))


def part_of(tail: Tail, t):
  """The (tail program, part) block of the partial outputs unit ``t`` writes
  (block (0, 0) for whole units, which write none)."""
  rest = jnp.maximum(t - tail.full, 0)
  return _div(rest, tail.parts), _rem(rest, tail.parts)


def key_range(lo, hi, part, parts):
  """Part ``part`` of ``parts`` (an int or a traced int32) near-equal
  consecutive pieces of ``[lo, hi)``."""
  n = hi - lo
  return lo + _div(part * n, parts), lo + _div((part + 1) * n, parts)


def _combine_kernel(*refs, tail: Tail, rows: int, n_acc: int, has_l: bool):
  accs, (m_ref, *rest) = refs[:n_acc], refs[n_acc:]
  l_ref = rest.pop(0) if has_l else None
  _, _, out_ref, lse_ref = rest  # the first two are aliased to these
  u = pl.program_id(0)
  sl = pl.ds(pl.program_id(1) * rows, rows)
  ms = [m_ref[u, j, sl] for j in range(tail.parts)]
  top = functools.reduce(jnp.maximum, ms)
  top_safe = jnp.where(top == -jnp.inf, 0.0, top)
  ws = [jnp.exp2(m - top_safe) for m in ms]
  # Normalised parts (no l): each weighs 1, or 0 through its m = -inf.
  l_sum = sum(w * (l_ref[u, j, sl] if has_l else 1.0) for j, w in enumerate(ws))
  part = lambda j: sum(a[u, j, sl, :].astype(jnp.float32) for a in accs)
  acc = sum(w[:, None] * part(j) for j, w in enumerate(ws))
  ok = (top > -jnp.inf) & (l_sum > 0)
  l_safe = jnp.where(ok, l_sum, 1.0)
  out_ref[...] = (acc / l_safe[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(ok, (top_safe + jnp.log2(l_safe)) * LN2, -jnp.inf)


# Rows per merge program: a tail block's rows are spread over several programs so
# that the merge's reads are not limited by one program per tail block (H200,
# 2026-11-23: 17 us for 68 blocks of 5 parts with one 4-warp program per block).
COMBINE_ROWS = 32


def combine(out, lse, partials, tail: Tail, coords, block_q: int, interpret: bool):
  """Writes the tail blocks of ``out [B, Sqp, H, Dv]`` and ``lse [B, H, Sqp]`` in
  place from ``partials = (acc [T, k, bq, Dv], m [T, k, bq], l [T, k, bq])``: acc
  and l are summed with base-2 weights relative to the parts' common row max (``m``
  is in log2 units). ``acc`` may be a tuple of arrays whose fp32 sum is the part's
  accumulator (e.g. a high and a low half), and ``l`` None for parts whose acc is
  already normalised (``m`` then being the part's lse in log2 units).
  ``coords(program) -> (q block, batch, head)``."""
  accs, m, l = partials
  accs = tuple(accs) if isinstance(accs, (tuple, list)) else (accs,)
  partials = accs + (m,) + (() if l is None else (l,))
  rows = min(COMBINE_ROWS, block_q)
  chunks = block_q // rows
  assert chunks * rows == block_q, (block_q, rows)

  def out_index(u, r):
    i, b, h = coords(tail.full + u)
    return b, i * chunks + r, h, 0

  def lse_index(u, r):
    i, b, h = coords(tail.full + u)
    return b, h, i * chunks + r

  # The tail block's output and lse rows, read (aliased) and written by one spec.
  blocks = [pl.BlockSpec((None, rows, None, out.shape[3]), out_index),
            pl.BlockSpec((None, None, rows), lse_index)]
  return pl.pallas_call(
      functools.partial(_combine_kernel, tail=tail, rows=rows, n_acc=len(accs),
                        has_l=l is not None),
      grid=(tail.count, chunks),
      in_specs=[pl.BlockSpec(x.shape, lambda u, r, n=x.ndim: (0,) * n)
                for x in partials] + blocks,
      out_specs=blocks,
      out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype),
                 jax.ShapeDtypeStruct(lse.shape, lse.dtype)],
      input_output_aliases={len(partials): 0, len(partials) + 1: 1},
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="flashjax_pallas_triton_fwd_tail",
  )(*partials, out, lse)
