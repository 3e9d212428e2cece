"""Row windows of larger arrays, for kernels that read their operands in place.

A ring hop's kernels read K and V out of the message that brought them (one flat
buffer, common/ring.py ``Packet``) and, in the zigzag layout, q, dO or K rows of
one chunk. Sliced in XLA, each is a copy before a custom call, which takes whole
operands: two of 33-35 us per forward hop at 8k rows per GPU on four H200s
(2026-11-26, docs/reports/2026-11-26-h200x4-ring-scaling.md). A :class:`Rows`
names the window instead; a platform function marked with :func:`takes_rows`
gets it as it is and reads the window through its kernel's offsets, any other
gets the slice (:func:`materialize`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
  """``base[batch:batch + count, start:start + length]``, not sliced.

  Attributes:
    base: an array of rank >= 2; axis 0 is the batch, axis 1 the rows.
    batch, count: the window's first batch entry and their number.
    start, length: its first row and their number.
  """

  base: Any
  batch: int = dataclasses.field(metadata=dict(static=True))
  count: int = dataclasses.field(metadata=dict(static=True))
  start: int = dataclasses.field(metadata=dict(static=True))
  length: int = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    # Pytree maps rebuild windows around other leaves (placeholders, dtypes);
    # only a base with batch and row axes is checked.
    if len(getattr(self.base, "shape", ())) < 2:
      return
    b, s = self.base.shape[:2]
    if not (0 <= self.batch and self.batch + self.count <= b and 0 <= self.start
            and self.start + self.length <= s):
      raise ValueError(f"window batch {self.batch}+{self.count}, rows "
                       f"{self.start}+{self.length} outside shape {self.base.shape}")

  @classmethod
  def of(cls, x) -> Rows:
    return x if isinstance(x, Rows) else cls(x, 0, x.shape[0], 0, x.shape[1])

  @property
  def shape(self) -> tuple:
    return (self.count, self.length) + tuple(self.base.shape[2:])

  @property
  def dtype(self):
    return self.base.dtype

  @property
  def at(self) -> tuple[int, int]:
    """``(batch, start)``: the window's offsets in ``base``."""
    return self.batch, self.start

  def rows(self, start: int, length: int) -> Rows:
    """Rows ``[start, start + length)`` of this window."""
    if start < 0 or start + length > self.length:
      raise ValueError(f"rows {start}+{length} outside a window of {self.length}")
    return dataclasses.replace(self, start=self.start + start, length=length)

  def array(self) -> jax.Array:
    """The window as its own array (an XLA slice: fused where its consumer is
    a fusion, a copy before a custom call)."""
    if self.shape == tuple(self.base.shape):
      return self.base
    starts = (self.batch, self.start) + (0,) * (self.base.ndim - 2)
    limits = (self.batch + self.count, self.start + self.length) + tuple(
        self.base.shape[2:])
    return jax.lax.slice(self.base, starts, limits)


def materialize(tree):
  """``tree`` with every :class:`Rows` replaced by its array."""
  return jax.tree.map(lambda x: x.array() if isinstance(x, Rows) else x, tree,
                      is_leaf=lambda x: isinstance(x, Rows))


def takes_rows(fn):
  """Marks a platform's forward or backward as taking :class:`Rows` operands:
  q, k and v, and the backward's out and dO (its lse and dlse stay arrays)."""
  fn.takes_rows = True
  return fn


def accepts(fn) -> bool:
  return getattr(fn, "takes_rows", False)
