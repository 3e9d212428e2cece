"""Conformance under ``jax_enable_x64``, inherited by :class:`ConformanceSuite`.

With x64 on, Python ints and ``jnp.arange`` become int64 and index arithmetic can
mix widths (``dynamic_slice`` rejects int32 and int64 indices in one call), and
int64 segment ids no longer fit int32 (a cast makes 0 and 2**32 equal). One small
case per platform instance covers both, so CI pays for a few cases, not for the
suite twice: a full bias with a window (the index mix of the backward), sinks,
and segment ids that are distinct only in 64 bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .compat import enable_x64

WIDE = 2 ** 32  # segment ids i * WIDE are equal to each other once cast to int32


def widen_segment_ids(fn):
  """``fn`` called with segment ids ``i`` replaced by ``i * WIDE`` in int64: the
  same segmentation, distinct only in 64 bits."""
  def call(**kwargs):
    ids = kwargs.get("segment_ids")
    if ids is not None:
      kwargs["segment_ids"] = tuple(jnp.asarray(x, jnp.int64) * WIDE for x in ids)
    return fn(**kwargs)
  return call


class X64Cases:
  """Mixed into ``ConformanceSuite``; uses its ``check`` and ``attention``."""

  def test_x64_bias_window_wide_segment_ids(self):
    from .conformance import Case  # conformance imports this module
    case = Case(batch=1, seq_q=40, seq_k=56, heads_q=2, heads_kv=1, head_dim=32,
                bias_shape=(-1, -1, -1, -1), sliding_window=(20, 3),
                segment_ids="padded", sinks=1, seed=47)
    attention = self.attention
    with enable_x64():
      assert jnp.arange(2).dtype == jnp.int64
      self.attention = widen_segment_ids(attention)
      try:
        self.check(case)
      finally:
        del self.attention  # the class's method again
