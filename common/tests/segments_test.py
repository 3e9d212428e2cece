"""Segment-id block ranges (common/segments.py) against the dense mask: every block
holding an allowed pair is in its visible range and meets; the ranges' ends are
blocks that meet and that the band reaches; all of it under jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from flashjax.common import segments
from flashjax.common.mask import Band, band_allowed


def documents(rng, batch, seq, max_doc, order):
  """``[B, seq]`` ids of documents of 1..max_doc tokens: in order, shuffled, or
  random ids per token."""
  out = np.zeros((batch, seq), np.int32)
  for b in range(batch):
    if order == "random":
      out[b] = rng.integers(0, 5, seq)
      continue
    lengths = []
    while sum(lengths) < seq:
      lengths.append(int(rng.integers(1, max_doc + 1)))
    ids = np.repeat(np.arange(len(lengths)), lengths)[:seq]
    if order == "shuffled":
      ids = rng.permutation(len(lengths))[ids]
    out[b] = ids
  return out


BANDS = [dict(), dict(right=0), dict(left=24, right=0), dict(left=10, right=30)]


@st.composite
def problems(draw):
  sq = draw(st.integers(1, 160))
  same = draw(st.booleans())
  sk = sq if same else draw(st.integers(1, 160))
  return dict(batch=draw(st.integers(1, 2)), seq_q=sq, seq_k=sk,
              block_q=draw(st.sampled_from([8, 16, 32])),
              block_kv=draw(st.sampled_from([8, 16, 32])),
              band=draw(st.sampled_from(range(len(BANDS)))),
              order=draw(st.sampled_from(["sorted", "shuffled", "random"])),
              max_doc=draw(st.sampled_from([3, 20, 70])),
              shared=same and draw(st.booleans()),
              seed=draw(st.integers(0, 2**16)))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _tables(q_ids, kv_ids, band, bq, bk, nq, nk):
  qr = segments.block_id_ranges(q_ids, bq, nq)
  kr = segments.block_id_ranges(kv_ids, bk, nk)
  return (qr, kr, segments.visible_kv_blocks(qr, kr, band, bq, bk),
          segments.visible_q_blocks(qr, kr, band, bq, bk))


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(p=problems())
def test_visible_ranges_cover_the_dense_segment_mask(p):
  rng = np.random.default_rng(p["seed"])
  b, sq, sk, bq, bk = p["batch"], p["seq_q"], p["seq_k"], p["block_q"], p["block_kv"]
  band = Band(seq_q=sq, seq_k=sk, **BANDS[p["band"]])
  q_ids = documents(rng, b, sq, p["max_doc"], p["order"])
  kv_ids = q_ids if p["shared"] else documents(rng, b, sk, p["max_doc"], p["order"])
  # One padding block beyond the ids on each side, as the kernels' tables have.
  nq, nk = -(-sq // bq) + 1, -(-sk // bk) + 1
  (qmin, qmax), (kmin, kmax), (lo, hi), (lo_t, hi_t) = jax.tree.map(
      np.asarray, _tables(q_ids, kv_ids, band, bq, bk, nq, nk))
  band_dense = np.ones((sq, sk), bool)
  if not band.is_full:
    band_dense = band_allowed(np.arange(sq)[:, None], np.arange(sk)[None, :], band)
  dense = band_dense & (q_ids[:, :, None] == kv_ids[:, None, :])
  meet = ((qmin[:, :, None] <= kmax[:, None, :]) &
          (kmin[:, None, :] <= qmax[:, :, None]))
  for x in range(b):
    for i in range(nq):
      rows = q_ids[x, i * bq:(i + 1) * bq]
      if rows.size:
        assert (qmin[x, i], qmax[x, i]) == (rows.min(), rows.max())
      assert 0 <= lo[x, i] <= hi[x, i] <= nk
      for j in range(nk):
        blk = dense[x, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        if blk.any():
          assert meet[x, i, j] and lo[x, i] <= j < hi[x, i], (x, i, j)
          assert lo_t[x, j] <= i < hi_t[x, j], (x, i, j)
      if hi[x, i] > lo[x, i]:  # tight: both ends meet and are in the band's reach
        for j in (lo[x, i], hi[x, i] - 1):
          assert meet[x, i, j]
          assert band_dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
    for j in range(nk):
      assert 0 <= lo_t[x, j] <= hi_t[x, j] <= nq
      if hi_t[x, j] > lo_t[x, j]:
        for i in (lo_t[x, j], hi_t[x, j] - 1):
          assert meet[x, i, j]
          assert band_dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
  if p["order"] == "sorted" and p["shared"]:
    # Sorted shared ids: blocks meet iff they share an id, so every block of the
    # range meets (no per-block predicate is needed).
    for x in range(b):
      for i in range(nq):
        assert meet[x, i, lo[x, i]:hi[x, i]].all()


def test_packed_documents_skip_the_blocks_between_them():
  """8 documents of 64 tokens in 16-token blocks, causal: each q block reaches
  its own document's blocks up to the diagonal, not the band's whole prefix."""
  ids = np.repeat(np.arange(8), 64)[None]
  band = Band(seq_q=512, seq_k=512, right=0)
  r = segments.block_id_ranges(jnp.asarray(ids), 16)
  lo, hi = segments.visible_kv_blocks(r, r, band, 16, 16)
  i = np.arange(32)
  np.testing.assert_array_equal(lo[0], i // 4 * 4)
  np.testing.assert_array_equal(hi[0], i + 1)
  lo_t, hi_t = segments.visible_q_blocks(r, r, band, 16, 16)
  np.testing.assert_array_equal(lo_t[0], i)
  np.testing.assert_array_equal(hi_t[0], i // 4 * 4 + 4)
  work = int((hi - lo).sum())
  assert work == 8 * (4 * 5 // 2)  # 80 of the band's 528 blocks


def test_narrow_clips_runs_to_the_range():
  bounds = (np.int32(2), np.int32(3), np.int32(7), np.int32(9))
  assert [int(x) for x in segments.narrow(bounds, 4, 8)] == [4, 4, 7, 8]
  assert [int(x) for x in segments.narrow(bounds, 0, 0)] == [0, 0, 0, 0]


def test_num_blocks_must_cover_the_ids():
  with pytest.raises(ValueError, match="num_blocks"):
    segments.block_id_ranges(jnp.zeros((1, 40), jnp.int32), 16, 2)


def test_single_id_blocks_are_one_unbroken_run():
  """Documents of 40 and 88 tokens in 16-token blocks: a q block inside the
  second document holds one id, and so do kv blocks 3-7 (block 2 straddles);
  a block straddling two documents has no such run. Shuffled ids break the run:
  none is reported."""
  ids = np.repeat([0, 1], [40, 88])[None].astype(np.int32)
  r = segments.block_id_ranges(jnp.asarray(ids), 16)
  lo, hi = segments.single_id_blocks(r, r)
  assert (int(lo[0, 5]), int(hi[0, 5])) == (3, 8)
  assert (int(lo[0, 0]), int(hi[0, 0])) == (0, 2)
  assert int(hi[0, 2] - lo[0, 2]) == 0  # q block 2 holds both ids
  lo_t, hi_t = segments.single_id_blocks(r, r, over_kv=False)
  assert (int(lo_t[0, 4]), int(hi_t[0, 4])) == (3, 8)
  broken = np.array([[0] * 16 + [1] * 16 + [0] * 16], np.int32)
  rb = segments.block_id_ranges(jnp.asarray(broken), 16)
  lo_b, hi_b = segments.single_id_blocks(rb, rb)
  assert int(hi_b[0, 0] - lo_b[0, 0]) == 0
  assert (int(lo_b[0, 1]), int(hi_b[0, 1])) == (1, 2)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _spans(q_ids, kv_ids, band, seq_q, seq_k, over_kv):
  return segments.spans(q_ids, kv_ids, band, seq_q, seq_k, over_kv=over_kv)


def _span_mask(spans, n_other, over_kv):
  """The ``[B, Sq', Sk']`` mask that per-row spans ``[B, 2, n]`` describe."""
  other = np.arange(n_other)[None, None, :]
  lo, hi = spans[:, 0, :, None], spans[:, 1, :, None]
  m = (other >= lo) & (other < hi)
  return m if over_kv else np.swapaxes(m, 1, 2)


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(p=problems(), pad=st.sampled_from([0, 5]), padding_id=st.booleans(),
       big_ids=st.booleans())
def test_spans_are_the_dense_mask_for_contiguous_segments(p, pad, padding_id, big_ids):
  """Each query's key span (each key's query span), with the band and the real
  lengths folded in, is exactly the dense mask for contiguous segments: sorted
  or shuffled documents, with or without a trailing padding id, ids at both
  ends of their side's range ``[-S, S)``, and ids padded past the real lengths
  by repeating the last one (as the kernels' operands are)."""
  rng = np.random.default_rng(p["seed"])
  b, sq, sk = p["batch"], p["seq_q"], p["seq_k"]
  if p["order"] == "random":  # not contiguous: no promise to check
    p = dict(p, order="shuffled")
  band = Band(seq_q=sq, seq_k=sk, **BANDS[p["band"]])
  q_ids = documents(rng, b, sq, p["max_doc"], p["order"])
  kv_ids = q_ids if p["shared"] else documents(rng, b, sk, p["max_doc"], p["order"])
  if padding_id:  # varlen padding: a trailing run of -1 on each side
    q_ids, kv_ids = q_ids.copy(), kv_ids.copy()
    q_ids[:, sq - sq // 4:] = -1
    kv_ids[:, sk - sk // 3:] = -1
    if p["shared"]:
      kv_ids = q_ids
  if big_ids and min(sq, sk) >= 4:  # ids at both ends of [-S, S)
    spread = lambda x, n: np.where(x < 0, x, np.where(
        x % 2 == 0, n - 1 - x // 2, -n + x // 2)).astype(np.int32)
    q_ids, kv_ids = (spread(q_ids, min(sq, sk)),
                     spread(q_ids if p["shared"] else kv_ids, min(sq, sk)))
  edge = lambda x: np.pad(x, ((0, 0), (0, pad)), mode="edge")
  qp, kp = edge(q_ids), edge(kv_ids)
  rows, cols = np.arange(sq + pad)[:, None], np.arange(sk + pad)[None, :]
  dense = (qp[:, :, None] == kp[:, None, :]) & (rows < sq) & (cols < sk)
  if not band.is_full:
    dense &= np.asarray(band_allowed(rows, cols, band))
  keep = (rows < sq) & (cols < sk)  # rows past the real lengths are never read
  for over_kv in (True, False):
    span = np.asarray(_spans(qp, kp, band, sq, sk, over_kv))
    assert span.shape == (b, 2, (sq if over_kv else sk) + pad)
    got = _span_mask(span, (sk if over_kv else sq) + pad, over_kv)
    np.testing.assert_array_equal(got & keep, dense, err_msg=f"over_kv={over_kv}")


def test_a_query_id_absent_from_the_keys_sees_nothing():
  """A query whose id no key holds gets an empty span, also where its id shares
  a slot with a key's (ids equal modulo twice the keys' length)."""
  q = jnp.asarray([[0, 7, 64, 3, 2**31 - 1, 69]], jnp.int32)
  kv = jnp.asarray([[0, 0, 3, 3] + [5] * 28], jnp.int32)
  span = segments.spans(q, kv, None, 6, 32)
  np.testing.assert_array_equal(np.asarray(span)[0],
                                [[0, 0, 0, 2, 0, 0], [2, 0, 0, 4, 0, 0]])


def test_ids_at_both_ends_of_their_range_keep_their_own_runs():
  """Ids ``-S`` and ``0`` (and ``-1`` and ``S - 1``) differ by the length: each
  keeps its own run."""
  kv = jnp.asarray([[0] * 8 + [-32] * 8 + [31] * 8 + [-1] * 8], jnp.int32)
  q = jnp.asarray([[-32, 0, -1, 31]], jnp.int32)
  span = segments.spans(q, kv, None, 4, 32)
  np.testing.assert_array_equal(np.asarray(span)[0], [[8, 0, 24, 16], [16, 8, 32, 24]])


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7))
def _span_tables(q_ids, kv_ids, band, seq_q, seq_k, over_kv, block, other_block):
  spans = segments.spans(q_ids, kv_ids, band, seq_q, seq_k, over_kv=over_kv)
  return spans, segments.span_blocks(spans, block, other_block)


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(p=problems(), padding_id=st.booleans())
def test_span_blocks_cover_the_mask_and_their_unmasked_run_is_whole(p, padding_id):
  """segments.span_blocks per own block (queries, or keys for the dK/dV side):
  every block of the other side holding an allowed pair of the block's real
  positions lies in ``[lo, hi)``, whose ends hold one of its spans' positions;
  every block of ``[one_lo, one_hi)`` is allowed for every position of the
  block, padded ones included (the kernels mask nothing there); ``(0, 0)``
  where a block sees nothing."""
  rng = np.random.default_rng(p["seed"])
  b, sq, sk, bq, bk = p["batch"], p["seq_q"], p["seq_k"], p["block_q"], p["block_kv"]
  order = "shuffled" if p["order"] == "random" else p["order"]
  band = Band(seq_q=sq, seq_k=sk, **BANDS[p["band"]])
  q_ids = documents(rng, b, sq, p["max_doc"], order)
  kv_ids = q_ids if p["shared"] else documents(rng, b, sk, p["max_doc"], order)
  if padding_id:
    q_ids, kv_ids = q_ids.copy(), kv_ids.copy()
    q_ids[:, sq - sq // 3:] = -1
    kv_ids[:, sk - sk // 4:] = -1
  # Padded to whole blocks plus one by repeating the last id, as the kernels' are.
  sqp, skp = (-(-sq // bq) + 1) * bq, (-(-sk // bk) + 1) * bk
  qp = np.pad(q_ids, ((0, 0), (0, sqp - sq)), mode="edge")
  kp = np.pad(kv_ids, ((0, 0), (0, skp - sk)), mode="edge")
  rows, cols = np.arange(sqp)[:, None], np.arange(skp)[None, :]
  dense = (qp[:, :, None] == kp[:, None, :]) & (rows < sq) & (cols < sk)
  if not band.is_full:
    dense &= np.asarray(band_allowed(rows, cols, band))
  for over_kv in (True, False):
    own, other = (bq, bk) if over_kv else (bk, bq)
    allowed = dense if over_kv else np.swapaxes(dense, 1, 2)
    real = sq if over_kv else sk
    spans, table = (np.asarray(x) for x in _span_tables(
        qp, kp, band, sq, sk, over_kv, own, other))
    n_other = allowed.shape[2] // other
    for bi in range(b):
      for i in range(allowed.shape[1] // own):
        lo, hi, one_lo, one_hi = table[bi, :, i]
        block = allowed[bi, i * own:(i + 1) * own]
        hit = block[:min(own, max(real - i * own, 0))].reshape(-1, n_other, other)
        seen = np.flatnonzero(hit.any(axis=(0, 2)))
        assert ((seen >= lo) & (seen < hi)).all(), (over_kv, bi, i)
        sp = spans[bi, :, i * own:(i + 1) * own]
        if hi > lo:
          some = sp[0] < sp[1]
          assert (sp[0][some] // other).min() == lo
          assert -(-sp[1][some].max() // other) == hi
        else:
          assert (lo, hi) == (0, 0) and not (sp[0] < sp[1]).any()
        # The run is every block that each span of the block covers whole.
        starts = np.arange(n_other)[None, :] * other
        whole = np.flatnonzero(((starts >= sp[0][:, None]) &
                                (starts + other <= sp[1][:, None])).all(axis=0))
        want = (whole.min(), whole.max() + 1) if whole.size else (0, 0)
        assert (one_lo, one_hi) == want, (over_kv, bi, i)
        cover = np.arange(one_lo * other, one_hi * other)
        assert block[:max(real - i * own, 0)][:, cover].all(), (over_kv, bi, i)


def test_span_blocks_unmasked_run_of_documents_and_a_causal_band():
  """Two 64-token documents in 16-position blocks, causal: a query block sees
  its own document's blocks up to the diagonal, and needs the mask only on the
  diagonal block; a key block is seen by its document's queries from the
  diagonal on."""
  ids = jnp.asarray([[0] * 64 + [1] * 64], jnp.int32)
  band = Band(seq_q=128, seq_k=128, right=0)
  spans = segments.spans(ids, ids, band, 128, 128)
  table = np.asarray(segments.span_blocks(spans, 16, 16))[0]
  np.testing.assert_array_equal(table[:, 5], [4, 6, 4, 5])
  np.testing.assert_array_equal(table[:, 4], [4, 5, 0, 0])
  np.testing.assert_array_equal(table[:, 3], [0, 4, 0, 3])
  # The dK/dV side: key k of a document is seen by its queries from k on.
  key_spans = segments.spans(ids, ids, band, 128, 128, over_kv=False)
  table = np.asarray(segments.span_blocks(key_spans, 16, 16))[0]
  np.testing.assert_array_equal(table[:, 5], [5, 8, 6, 8])
  np.testing.assert_array_equal(table[:, 3], [3, 4, 0, 0])
  np.testing.assert_array_equal(table[:, 0], [0, 4, 1, 4])
