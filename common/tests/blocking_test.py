"""The shared index math (common/blocking.py, mask.tile_allowed) against the dense
band of common/mask.py, on drawn bands, lengths and block sizes: the block
ranges every platform walks (host tables and traced values alike) and the tile
predicate they mask with; the padded sizes of the Triton-based kernels on
hand-computed shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from flashjax.common import blocking
from flashjax.common import spec as spec_lib
from flashjax.common.launch import KernelConfig
from flashjax.common.mask import Band, band_allowed, tile_allowed

_bound = st.one_of(st.none(), st.integers(0, 3), st.integers(0, 70))


@st.composite
def problems(draw):
  seq_q = draw(st.one_of(st.just(1), st.integers(1, 70)))
  seq_k = draw(st.one_of(st.just(1), st.integers(1, 70)))
  if draw(st.booleans()):  # causal, with or without a left window
    left, right = draw(_bound), 0
  else:
    left, right = draw(_bound), draw(_bound)
  band = Band(seq_q=seq_q, seq_k=seq_k, left=left, right=right)
  # Few distinct block shapes, so the traced checks reuse their compiled ops.
  blocks = st.sampled_from([1, 2, 3, 7, 8, 16, 32])
  return (band, draw(blocks), draw(blocks), draw(st.integers(0, 2)),
          draw(st.booleans()), draw(st.booleans()))


def _expected(real, ext, b_out, b_in, n_out, strict_out, strict_in):
  """Per outer block (rows of ``real``), the reached and the full inner blocks:
  ``real [s_out, s_in]`` is the dense band, ``ext`` the band on the padded grid."""
  s_out, s_in = real.shape
  n_in = -(-s_in // b_in)
  rows, cols = n_out * b_out, n_in * b_in
  reach = np.zeros((rows, cols), bool)
  reach[:s_out, :s_in] = real
  full = np.array(ext[:rows, :cols])
  full[:s_out, :s_in] = real
  if strict_in:
    full[:, s_in:] = False
  full[s_out:] = strict_out is False  # padding rows constrain nothing
  shape = (n_out, b_out, n_in, b_in)
  reach = reach.reshape(shape).any((1, 3))
  full = full.reshape(shape).all((1, 3)) & reach
  return reach, full


def _check(table, reach, full):
  for o, (lo, a, b, hi) in enumerate(table):
    assert 0 <= lo <= a <= b <= hi <= reach.shape[1], (o, table[o])
    got_reach = np.zeros(reach.shape[1], bool)
    got_reach[lo:hi] = True
    assert (got_reach == reach[o]).all(), (o, table[o], reach[o])  # exact ranges
    got_full = np.zeros(reach.shape[1], bool)
    got_full[a:b] = True
    assert (got_full == full[o]).all(), (o, table[o], full[o])


def _traced(fn, starts):
  """``fn`` on traced int32 starts, padded to one length (one compile per op)."""
  padded = np.zeros(80, np.int32)
  padded[:len(starts)] = starts
  out = jax.vmap(lambda s: jnp.stack(fn(s)))(jnp.asarray(padded))
  return np.asarray(out)[:len(starts)]


@settings(max_examples=100, deadline=None)
@given(problems(), st.integers(0, 2**31 - 1))
def test_block_ranges_and_tile_predicate_match_the_dense_band(problem, seed):
  band, bq, bk, extra, strict_q, strict_kv = problem
  sq, sk = band.seq_q, band.seq_k
  nq, nk = -(-sq // bq) + extra, -(-sk // bk) + extra
  # The band's definition (Band.as_array) on the padded grid, in NumPy.
  ext = band_allowed(np.arange(nq * bq)[:, None], np.arange(nk * bk)[None, :], band)
  real = ext[:sq, :sk]

  # q blocks over kv blocks, and the transpose.
  kv = blocking.kv_block_table(band, bq, bk, nq, strict_q=strict_q,
                               strict_kv=strict_kv)
  _check(kv, *_expected(real, ext, bq, bk, nq, strict_q, strict_kv))
  # The reach matrix: exactly the tiles holding a real allowed pair.
  tiles = np.zeros_like(ext)
  tiles[:sq, :sk] = real
  assert (blocking.kv_block_reach(band, bq, bk, nq, nk)
          == tiles.reshape(nq, bq, nk, bk).any((1, 3))).all()
  q = blocking.q_block_table(band, bk, bq, nk, strict_kv=strict_kv,
                             strict_q=strict_q)
  _check(q, *_expected(real.T, ext.T, bk, bq, nk, strict_kv, strict_q))
  # Traced starts (as inside kernels) give the host tables.
  flags = dict(strict_q=strict_q, strict_kv=strict_kv)
  assert (_traced(lambda s: blocking.kv_block_range(band, s, bq, bk, **flags),
                  np.arange(nq) * bq) == kv).all()
  assert (_traced(lambda s: blocking.q_block_range(band, s, bk, bq, **flags),
                  np.arange(nk) * bk) == q).all()

  # The tile predicate of a drawn block is the mask's definition on its real
  # pairs and masks the padding keys; a block outside [lo, hi) allows nothing.
  rng = np.random.default_rng(seed)
  q_ids = rng.integers(0, 2, (1, nq * bq))
  kv_ids = rng.integers(0, 2, (1, nk * bk))
  dense = rng.random((1, 1, nq * bq, nk * bk)) < 0.8
  want = np.zeros((nq * bq, nk * bk), bool)
  want[:sq, :sk] = real & (q_ids[0, :sq, None] == kv_ids[0, None, :sk]) & dense[
      0, 0, :sq, :sk]  # Mask.as_array
  i, j = int(rng.integers(nq)), int(rng.integers(nk))
  rq, ck = slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk)
  for rows, cols in (blocking.positions(i, j, bq, bk),
                     blocking.positions(i, j, bq, bk, dense=False)):
    got = tile_allowed(band, rows, cols, padded_keys=nk * bk != sk,
                       q_ids=q_ids[0, rq, None], kv_ids=kv_ids[0, None, ck],
                       mask=dense[0, 0, rq, ck].astype(np.int8))
    got = np.broadcast_to(np.asarray(got), (bq, bk))
    real_rows = min(bq, max(0, sq - i * bq))
    assert (got[:real_rows] == want[rq, ck][:real_rows]).all()
    assert not got[:, max(0, sk - j * bk):].any()
  lo, _, _, hi = kv[i]
  if not lo <= j < hi:
    rows, cols = blocking.positions(i, j, bq, bk)
    assert not np.asarray(tile_allowed(band, rows, cols, padded_keys=True))[
        :max(0, sq - i * bq)].any()


@dataclasses.dataclass(frozen=True)
class _Padded(blocking.PaddedLengths):
  spec: object
  pad_q: int
  pad_k: int


def test_padded_lengths_on_hand_computed_shapes():
  # (seq_q, seq_k, head_dim, head_dim_v, pad_q, pad_k) -> padded (Sq, Sk, D, Dv)
  cases = {(100, 33, 40, 8, 64, 32): (128, 64, 64, 16),
           (128, 128, 128, 96, 128, 64): (128, 128, 128, 128),
           (1, 300, 256, 17, 16, 128): (16, 384, 256, 32),
           (65, 7, 16, 512, 32, 16): (96, 16, 16, 512)}
  for (sq, sk, d, dv, pq, pk), want in cases.items():
    s = spec_lib.abstract_spec(batch=1, seq_q=sq, seq_k=sk, heads_q=1, head_dim=d,
                               head_dim_v=dv)
    p = _Padded(s, pq, pk)
    got = (p.seq_q_padded, p.seq_k_padded, p.head_dim_padded, p.head_dim_v_padded)
    assert got == want, (sq, sk, d, dv, pq, pk, got)
  assert [blocking.round_up(n, 16) for n in (1, 15, 16, 17, 33)] == [16, 16, 16, 32, 48]


def test_shared_padding_is_the_largest_tile_of_the_kernels():
  cfg = lambda q, k: KernelConfig(block_q=q, block_kv=k)
  assert blocking.shared_padding([cfg(128, 64), cfg(64, 128), cfg(32, 32)]) == (128, 128)
  assert blocking.shared_padding([cfg(16, 64), cfg(64, 32)]) == (64, 64)
