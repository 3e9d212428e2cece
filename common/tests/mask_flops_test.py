"""Band bounds against the dense mask, and FLOP counts against counted pairs."""

import itertools

import numpy as np
import pytest

from flashjax.common import flops
from flashjax.common.mask import Band, Mask

BANDS = [Band(seq_q=sq, seq_k=sk, left=l, right=r)
         for sq, sk in ((16, 16), (10, 23), (23, 10), (1, 9))
         for l, r in itertools.product((None, 0, 3), (None, 0, 2, 30))]


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_kv_bounds_cover_exactly_the_dense_band(band):
  dense = np.asarray(band.as_array())
  for q_lo in range(band.seq_q):
    for q_hi in range(q_lo + 1, min(band.seq_q, q_lo + 5) + 1):
      lo, hi = band.kv_bounds(q_lo, q_hi)
      cols = np.flatnonzero(dense[q_lo:q_hi].any(axis=0))
      if cols.size == 0:
        assert hi <= lo
      else:
        assert (lo, hi) == (cols[0], cols[-1] + 1)


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_q_bounds_cover_exactly_the_dense_band(band):
  dense = np.asarray(band.as_array())
  for k_lo in range(band.seq_k):
    for k_hi in range(k_lo + 1, min(band.seq_k, k_lo + 5) + 1):
      lo, hi = band.q_bounds(k_lo, k_hi)
      rows = np.flatnonzero(dense[:, k_lo:k_hi].any(axis=1))
      if rows.size == 0:
        assert hi <= lo
      else:
        assert (lo, hi) == (rows[0], rows[-1] + 1)


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_attended_pairs_counts_the_dense_band(band):
  assert flops.attended_pairs(band) == int(np.asarray(band.as_array()).sum())


def test_causal_costs_about_half():
  full = flops.forward_flops(batch=8, heads_q=16, head_dim=128,
                             band=Band(seq_q=2048, seq_k=2048))
  causal = flops.forward_flops(batch=8, heads_q=16, head_dim=128,
                               band=Band(seq_q=2048, seq_k=2048, right=0))
  assert full == 4 * 8 * 16 * 2048 * 2048 * 128
  assert causal == full // 2 + 4 * 8 * 16 * 2048 * 128 // 2
  assert flops.backward_flops(batch=8, heads_q=16, head_dim=128,
                              band=Band(seq_q=2048, seq_k=2048)) == 2.5 * full


def test_mask_combines_all_parts():
  import jax.numpy as jnp
  band = Band(seq_q=4, seq_k=4, right=0)
  seg = (jnp.array([[0, 0, 1, 1]]), jnp.array([[0, 1, 1, 1]]))
  dense = jnp.array([[True, True, False, True]])[None, None]
  got = np.asarray(Mask(band=band, segment_ids=seg, dense=dense).as_array())[0, 0]
  want = np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 1]], bool)
  np.testing.assert_array_equal(got, want)
