"""Validation: every bad input raises ValueError naming the argument and value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import spec as spec_lib
from flashjax.common.mask import Band

B, SQ, SK, HQ, HKV, D = 2, 8, 12, 4, 2, 16


def _qkv(dtype=jnp.float32):
  return (jnp.ones((B, SQ, HQ, D), dtype), jnp.ones((B, SK, HKV, D), dtype),
          jnp.ones((B, SK, HKV, D), dtype))


q, k, v = _qkv()
ids_q, ids_k = jnp.zeros((B, SQ), jnp.int32), jnp.zeros((B, SK), jnp.int32)

BAD = [
    ("q rank", dict(q=q[0]), r"q must have rank 4 .* \(8, 4, 16\)"),
    ("k rank", dict(k=k[..., 0]), r"k must have rank 4"),
    ("zero size", dict(q=jnp.ones((B, 0, HQ, D))), r"zero-sized .* \(2, 0, 4, 16\)"),
    ("batch", dict(k=jnp.ones((3, SK, HKV, D)), v=jnp.ones((3, SK, HKV, D))),
     r"batch sizes differ"),
    ("kv length", dict(v=jnp.ones((B, SK + 1, HKV, D))), r"sequence lengths differ"),
    ("kv heads", dict(v=jnp.ones((B, SK, 1, D))), r"head counts differ"),
    ("head dim", dict(k=jnp.ones((B, SK, HKV, D + 1)), v=jnp.ones((B, SK, HKV, D + 1))),
     r"head dims differ"),
    ("groups", dict(q=jnp.ones((B, SQ, 3, D))),
     r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    ("int dtype", dict(q=q.astype(jnp.int32), k=k.astype(jnp.int32),
                       v=v.astype(jnp.int32)), r"q dtype must be one of .* int32"),
    ("mixed dtype", dict(k=k.astype(jnp.bfloat16)), r"share a dtype.* bfloat16"),
    ("scale zero", dict(softmax_scale=0.0), r"softmax_scale .* got 0.0"),
    ("scale nan", dict(softmax_scale=float("nan")), r"softmax_scale .* got nan"),
    ("window int", dict(sliding_window=-3), r"sliding_window must be >= 0 .* -3"),
    ("window pair", dict(sliding_window=(4, -2)), r"right bound .* \(4, -2\)"),
    ("window type", dict(sliding_window="big"), r"sliding_window must be .* 'big'"),
    ("window triple", dict(sliding_window=(1, 2, 3)), r"\(1, 2, 3\)"),
    ("causal type", dict(causal="yes"), r"causal must be a bool, got 'yes'"),
    ("segment pair", dict(segment_ids=ids_q), r"segment_ids must be a pair"),
    ("segment shape", dict(segment_ids=(ids_q, ids_q)),
     r"segment_ids\[1\] \(kv\) must have shape \[2, 12\], got \(2, 8\)"),
    ("segment dtype", dict(segment_ids=(ids_q.astype(jnp.float32), ids_k)),
     r"segment_ids\[0\] \(q\) must be integer, got dtype float32"),
    ("bias shape", dict(bias=jnp.ones((B, HQ, SQ, SK + 1))),
     r"bias of shape \(2, 4, 8, 13\) is not broadcastable to .*\[2, 4, 8, 12\]"),
    ("bias rank", dict(bias=jnp.ones((1, B, HQ, SQ, SK))), r"bias must have rank <= 4"),
    ("bias dtype", dict(bias=jnp.ones((SQ, SK), jnp.int32)),
     r"bias must be floating point, got dtype int32"),
    ("mask dtype", dict(mask=jnp.ones((SQ, SK))), r"mask must be bool .* float32"),
    ("mask shape", dict(mask=jnp.ones((HKV, SQ, SK), bool)),
     r"mask of shape \(2, 8, 12\) is not broadcastable"),
    ("soft cap", dict(logits_soft_cap=-1.0), r"logits_soft_cap .* got -1.0"),
    ("sinks shape", dict(sinks=jnp.ones((HKV,))), r"sinks must have shape \[Hq\].*\(2,\)"),
    ("sinks empty", dict(sinks=jnp.ones((HQ, 0))), r"at least one sink"),
    ("dropout rate", dict(dropout_rate=1.0, dropout_seed=1),
     r"dropout_rate must be in \[0, 1\), got 1.0"),
    ("dropout negative", dict(dropout_rate=-0.1, dropout_seed=1), r"got -0.1"),
    ("dropout seed", dict(dropout_rate=0.1), r"dropout_seed is required"),
    ("seed shape", dict(dropout_rate=0.1, dropout_seed=jnp.ones((2,), jnp.int32)),
     r"dropout_seed must be an integer scalar"),
    ("return_lse", dict(return_lse=1), r"return_lse must be a bool, got 1"),
    ("contiguous type", dict(segment_ids=(ids_q, ids_k), contiguous_segments=1),
     r"contiguous_segments must be a bool, got 1"),
    ("contiguous alone", dict(contiguous_segments=True),
     r"contiguous_segments=True needs segment_ids"),
    ("contiguous runs", dict(
        segment_ids=(ids_q, ids_k.at[1, 3].set(7).at[1, 5:7].set(7)),
        contiguous_segments=True),
     r"segment_ids\[1\] \(kv\) row 1 holds id 0 in 3 separate runs"),
    ("not array", dict(q=[[1.0]]), r"q must be an array, got list"),
]


@pytest.mark.parametrize("name,kwargs,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_with_argument_and_value(name, kwargs, pattern):
  args = dict(q=q, k=k, v=v)
  args.update(kwargs)
  with pytest.raises(ValueError, match=pattern):
    spec_lib.canonicalize(**args)


def test_at_least_fifteen_distinct_bad_inputs():
  assert len({b[2] for b in BAD}) >= 15


def test_canonical_forms():
  bias = jnp.ones((SQ, SK))
  sinks = jnp.ones((HQ,))
  ops, spec = spec_lib.canonicalize(
      q, k, v, bias=bias, sinks=sinks, causal=True, sliding_window=5,
      segment_ids=(ids_q.astype(jnp.int16), ids_k), dropout_rate=0.1,
      dropout_seed=-1, return_lse=True)
  assert ops.bias.shape == (1, 1, SQ, SK)
  assert ops.sinks.shape == (HQ, 1)
  assert ops.q_segment_ids.dtype == jnp.int32
  assert ops.dropout_seed.dtype == jnp.uint32 and int(ops.dropout_seed) == 2**32 - 1
  assert spec.band == Band(seq_q=SQ, seq_k=SK, left=5, right=0)
  assert spec.softmax_scale == pytest.approx(D ** -0.5)
  assert spec.group_size == 2
  assert spec.features == {"causal", "window", "segment_ids", "bias", "sinks",
                           "dropout", "lse"}
  hash(spec)  # static half of custom_vjp / jit cache keys


def test_window_forms():
  pw = spec_lib.parse_window
  assert pw(None, False) == (None, None)
  assert pw(None, True) == (None, 0)
  assert pw(-1, False) == (None, None)
  assert pw(8, False) == (8, 0)
  assert pw((-1, -1), False) == (None, None)
  assert pw((3, 4), True) == (3, 0)
  assert pw((None, 5), True) == (None, 0)


def test_features_of_plain_and_causal_calls():
  assert spec_lib.canonicalize(q, k, v)[1].features == frozenset()
  assert spec_lib.canonicalize(q, k, v, causal=True)[1].features == {"causal"}
  assert spec_lib.canonicalize(q, k, v, sliding_window=(-1, 0))[1].features == {
      "window"}


def test_abstract_spec_matches_concrete():
  sd = jax.ShapeDtypeStruct
  spec = spec_lib.abstract_spec(
      batch=B, seq_q=SQ, seq_k=SK, heads_q=HQ, heads_kv=HKV, head_dim=D,
      dtype="float32", causal=True, bias=sd((SQ, SK), jnp.float32),
      segment_ids=(sd((B, SQ), jnp.int32), sd((B, SK), jnp.int32)),
      dropout_rate=0.2)
  _, concrete = spec_lib.canonicalize(
      q, k, v, causal=True, bias=jnp.ones((SQ, SK)), segment_ids=(ids_q, ids_k),
      dropout_rate=0.2, dropout_seed=3)
  assert spec == concrete


def test_validation_under_jit_is_static():
  @jax.jit
  def f(q):
    return spec_lib.canonicalize(q, k, v, causal=True)[0].q

  np.testing.assert_array_equal(f(q), q)


def test_contiguous_segments_reach_the_spec_and_traced_ids_pass_unchecked():
  """The promise travels in the spec; ids traced under jit cannot be checked
  when the call is traced, so a broken promise passes there (the docs say
  its results are undefined)."""
  runs = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, -1]] * B, jnp.int32)
  _, spec = spec_lib.canonicalize(q, q, q, segment_ids=(runs, runs),
                                  contiguous_segments=True)
  assert spec.contiguous_segments and spec.has_segment_ids
  assert not spec_lib.canonicalize(q, q, q, segment_ids=(runs, runs))[1].contiguous_segments
  broken = runs.at[:, 7].set(0)
  with pytest.raises(ValueError, match=r"segment_ids\[0\] \(q\) row 0 holds id 0"):
    spec_lib.canonicalize(q, q, q, segment_ids=(broken, broken), contiguous_segments=True)

  @jax.jit
  def traced(ids):
    return spec_lib.canonicalize(q, q, q, segment_ids=(ids, ids),
                                 contiguous_segments=True)[0].q_segment_ids
  np.testing.assert_array_equal(traced(broken), broken)


def test_contiguous_segments_need_ids_within_their_length():
  """Ids outside ``[-S, S)`` of their side break the promise (the kernels'
  hash slots need them there): named with the side and the id."""
  runs = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, -8]] * B, jnp.int32)
  spec_lib.canonicalize(q, q, q, segment_ids=(runs, runs), contiguous_segments=True)
  with pytest.raises(ValueError, match=r"segment_ids\[1\] \(kv\) in \[-8, 8\).*got id 8"):
    spec_lib.canonicalize(q, q, q, segment_ids=(runs, runs.at[:, 0:2].set(8)),
                          contiguous_segments=True)
  with pytest.raises(ValueError, match=r"segment_ids\[0\] \(q\) in \[-8, 8\).*got id -9"):
    spec_lib.canonicalize(q, q, q, segment_ids=(runs.at[:, 7].set(-9), runs),
                          contiguous_segments=True)


def test_contiguous_segments_keep_wide_ids_as_they_are():
  """Wide (int64) ids under the promise are cast, not ranked: ranking all of a
  call's ids would spread them past ``[-S, S)``, which the spans' hash slots
  need."""
  from flashjax.common import compat
  with compat.enable_x64():
    runs = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, -1]] * B, jnp.int64)
    ops, _ = spec_lib.canonicalize(q, q, q, segment_ids=(runs, runs),
                                   contiguous_segments=True)
    assert ops.q_segment_ids.dtype == jnp.int32
    np.testing.assert_array_equal(ops.q_segment_ids, runs)
    np.testing.assert_array_equal(ops.kv_segment_ids, runs)
