"""Packed-document cases: rows of many documents told apart by segment ids.

:class:`PackedSegmentCases` is part of every :class:`conformance.ConformanceSuite`:
one causal case whose rows hold many short sorted documents and documents of
mixed lengths with unsorted ids (the blocks a q block meets need not form one
run), checked against the reference like every case.

:func:`check_skips_between_documents` is for platforms that skip the blocks
between documents (common/segments.py): the values of one document are NaN, so
any block of it that a kernel computes for another document, even masked,
turns that document's outputs or gradients into NaN (``0 * NaN``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import reference, tolerances

KINDS = ("documents",)


def segment_ids(rng, kind: str, batch: int, seq: int):
  """``[B, seq]`` int32 ids of packed documents (``kind`` is ``"documents"``):
  even rows hold sorted documents of 4-24 tokens; odd rows documents of mixed
  lengths (1-8 tokens or up to ~seq/2) whose ids are shuffled, so the blocks a
  q block meets need not form one run."""
  out = np.zeros((batch, seq), np.int32)
  for b in range(batch):
    mixed = b % 2 == 1
    lengths = []
    while sum(lengths) < seq:
      short = not mixed or rng.random() < 0.5
      hi = 24 if not mixed else (8 if short else max(9, seq // 2))
      lo = 4 if not mixed else (1 if short else 9)
      lengths.append(int(rng.integers(lo, hi + 1)))
    ids = np.repeat(np.arange(len(lengths)), lengths)[:seq]
    if mixed:
      ids = rng.permutation(len(lengths))[ids]
    out[b] = ids
  return out


class PackedSegmentCases:
  """Mixin of the conformance suite (it provides ``check``)."""

  def test_packed_documents(self):
    """Many short sorted documents (row 0) and mixed lengths with shuffled ids
    (row 1), causal: per-row block ranges differ."""
    from .conformance import Case
    self.check(Case(batch=2, seq_q=128, seq_k=128, heads_q=2, heads_kv=1,
                    head_dim=32, causal=True, segment_ids="documents", seed=5))


def check_skips_between_documents(attention, *, doc_len: int, causal: bool,
                                  dtype: str = "float32", head_dim: int = 32):
  """Four documents of ``doc_len`` tokens (a multiple of every block size, so no
  block holds two of them); the second one's values are NaN. The other three
  documents' outputs and gradients must be finite and match the reference on
  clean inputs. ``attention(q, k, v, **kwargs)`` is the platform's entry point."""
  seq, d = 4 * doc_len, head_dim
  rng = np.random.default_rng(doc_len + causal)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  q, k, v = normal(1, seq, 2, d), normal(1, seq, 1, d), normal(1, seq, 1, d)
  do = normal(1, seq, 2, d)
  ids = jnp.asarray(np.repeat(np.arange(4, dtype=np.int32), doc_len)[None])
  kw = dict(segment_ids=(ids, ids), causal=causal)
  poisoned = v.at[:, doc_len:2 * doc_len].set(jnp.nan)
  got = jax.vjp(jax.jit(lambda *a: attention(*a, **kw)), q, k, poisoned)
  ref = jax.vjp(jax.jit(lambda *a: reference.attention(*a, precision="float32", **kw)),
                q, k, v)
  keep = np.asarray(ids[0] != 1)
  names = ("out", "dq", "dk", "dv")
  ref_grads = ref[1](do.astype(ref[0].dtype))
  for name, x, y in zip(names, (got[0],) + got[1](do), (ref[0],) + ref_grads):
    x, y = np.asarray(x)[:, keep], np.asarray(y)[:, keep]
    assert np.isfinite(x).all(), f"{name}: a block of another document was computed"
    tol = (tolerances.forward if name == "out" else tolerances.grad)(dtype)
    tolerances.assert_close(x, y, tol, name=name)
