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

The Mosaic-GPU persistent forward (mosaic/fwd.py) uses the same plan for its
last round of tiles. This module holds the plan (a host cost model) and the
traced index math both forwards share, and no kernel: the combine kernel, which
both launch, is tail_merge.py.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

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
