"""The reference against a plain NumPy (float64) implementation written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from flashjax.common import dropout, reference


def numpy_attention(q, k, v, *, bias=None, mask=None, causal=False, window=(None, None),
                    segment_ids=None, scale=None, cap=None, sinks=None, rate=0.0,
                    seed=0):
  """Loops over batch and heads; written without the library's helpers."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  scale = 1 / np.sqrt(d) if scale is None else scale
  out = np.zeros((b, sq, hq, v.shape[-1]))
  lse = np.full((b, hq, sq), -np.inf)
  left, right = window
  if causal:
    right = 0 if right is None else min(right, 0)
  for bi in range(b):
    for h in range(hq):
      kh = h // (hq // hkv)
      s = q[bi, :, h] @ k[bi, :, kh].T * scale
      if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64),
                                (b, hq, sq, sk))[bi, h]
      if cap is not None:
        s = cap * np.tanh(s / cap)
      ok = np.ones((sq, sk), bool)
      for i in range(sq):
        for j in range(sk):
          diag = i + sk - sq
          if left is not None and j < diag - left:
            ok[i, j] = False
          if right is not None and j > diag + right:
            ok[i, j] = False
      if segment_ids is not None:
        qi, ki = (np.asarray(x) for x in segment_ids)
        ok &= qi[bi][:, None] == ki[bi][None, :]
      if mask is not None:
        ok &= np.broadcast_to(np.asarray(mask), (b, hq, sq, sk))[bi, h]
      extra = [] if sinks is None else list(np.atleast_1d(
          np.asarray(sinks, np.float64)[h]))
      for i in range(sq):
        logits = list(s[i][ok[i]]) + extra
        if not logits:
          continue
        m = max(logits)
        denom = sum(np.exp(x - m) for x in logits)
        lse[bi, h, i] = m + np.log(denom)
        p = np.where(ok[i], np.exp(s[i] - m) / denom, 0.0)
        if rate:
          keep = dropout.keep_numpy(seed, bi, h, i, np.arange(sk), rate)
          p = np.where(keep, p / (1 - rate), 0.0)
        out[bi, i, h] = p @ v[bi, :, kh]
  return out, lse


def _inputs(seed, b=2, sq=9, sk=12, hq=4, hkv=2, d=8, dv=8):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((b, sq, hq, d)).astype(np.float32),
          rng.standard_normal((b, sk, hkv, d)).astype(np.float32),
          rng.standard_normal((b, sk, hkv, dv)).astype(np.float32))


CASES = {
    "plain": ({}, {}),
    "causal": (dict(causal=True), dict(causal=True)),
    "window": (dict(sliding_window=(3, 1)), dict(window=(3, 1))),
    "window_int": (dict(sliding_window=4), dict(window=(4, 0))),
    "causal_window": (dict(causal=True, sliding_window=(2, 5)),
                      dict(causal=True, window=(2, 5))),
    "scale": (dict(softmax_scale=0.7), dict(scale=0.7)),
    "soft_cap": (dict(logits_soft_cap=1.5, softmax_scale=1.0),
                 dict(cap=1.5, scale=1.0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("sizes", [(9, 12), (12, 9), (1, 5), (7, 7)])
def test_static_features_match_numpy(name, sizes):
  kw, nkw = CASES[name]
  q, k, v = _inputs(hash(name) % 1000, sq=sizes[0], sk=sizes[1])
  out, lse = reference.attention(q, k, v, return_lse=True, **kw)
  nout, nlse = numpy_attention(q, k, v, **nkw)
  np.testing.assert_allclose(out, nout, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, nlse, atol=2e-5, rtol=2e-5)


def test_array_features_match_numpy():
  q, k, v = _inputs(1, d=8, dv=6)
  rng = np.random.default_rng(2)
  bias = rng.standard_normal((1, 4, 9, 12)).astype(np.float32)
  mask = rng.random((2, 1, 9, 12)) < 0.7
  seg = (np.array([[0] * 5 + [1] * 4, [0] * 9]), np.array([[0] * 6 + [1] * 6,
                                                           [0] * 3 + [1] * 9]))
  sinks = rng.standard_normal((4, 2)).astype(np.float32)
  out, lse = reference.attention(q, k, v, bias=bias, mask=mask,
                                 segment_ids=tuple(map(jnp.asarray, seg)),
                                 sinks=sinks, return_lse=True)
  nout, nlse = numpy_attention(q, k, v, bias=bias, mask=mask, segment_ids=seg,
                               sinks=sinks)
  np.testing.assert_allclose(out, nout, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, nlse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rate", [0.2, 0.6])
def test_dropout_matches_numpy(rate):
  q, k, v = _inputs(3)
  out = reference.attention(q, k, v, dropout_rate=rate, dropout_seed=99, causal=True)
  nout, _ = numpy_attention(q, k, v, causal=True, rate=rate, seed=99)
  np.testing.assert_allclose(out, nout, atol=2e-5, rtol=2e-5)


def test_sinks_vector_form():
  q, k, v = _inputs(4)
  sinks = np.linspace(-1, 1, 4).astype(np.float32)
  out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True)
  nout, nlse = numpy_attention(q, k, v, sinks=sinks)
  np.testing.assert_allclose(out, nout, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(lse, nlse, atol=2e-5, rtol=2e-5)


def test_fully_masked_rows_are_zero_with_finite_zero_gradients():
  q, k, v = _inputs(5, sq=12, sk=5)  # causal, Sq > Sk: rows 0..6 see nothing
  bias = np.zeros((12, 5), np.float32) + 0.1

  def loss(q, k, v, bias):
    out, lse = reference.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

  out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
  assert np.all(np.asarray(out)[:, :7] == 0)
  assert np.all(np.asarray(lse)[:, :, :7] == -np.inf)
  assert np.isfinite(np.asarray(lse)[:, :, 7:]).all()
  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  assert np.all(np.asarray(grads[0])[:, :7] == 0)
  assert np.all(np.asarray(grads[3])[:7] == 0)


def test_fully_masked_rows_with_sinks_have_sink_lse():
  q, k, v = _inputs(6, sq=8, sk=3)
  sinks = np.full((4,), 0.5, np.float32)
  out, lse = reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
  np.testing.assert_allclose(np.asarray(lse)[:, :, :5], 0.5, rtol=1e-6)
  assert np.all(np.asarray(out)[:, :5] == 0)


def test_float64_precision():
  q, k, v = _inputs(7)
  with jax.enable_x64(True):
    out, lse = reference.attention(q.astype(np.float64), k.astype(np.float64),
                                   v.astype(np.float64), causal=True,
                                   return_lse=True, precision="float64")
    assert out.dtype == jnp.float64
  nout, nlse = numpy_attention(q, k, v, causal=True)
  np.testing.assert_allclose(out, nout, atol=1e-12, rtol=1e-12)
  np.testing.assert_allclose(lse, nlse, atol=1e-12, rtol=1e-12)


def test_float64_needs_x64():
  q, k, v = _inputs(7)
  with pytest.raises(ValueError, match="x64"):
    reference.attention(q, k, v, precision="float64")


@pytest.mark.parametrize("kwargs", [
    dict(causal=True),
    dict(sliding_window=(3, 2), logits_soft_cap=2.0),
    dict(segment_ids=(np.array([[0] * 4 + [1] * 5] * 2), np.array([[0] * 6 + [1] * 6] * 2))),
    dict(dropout_rate=0.3, dropout_seed=5),
])
def test_gradients_by_finite_differences(kwargs):
  """Autodiff of the reference is checked in fp64 against finite differences."""
  q, k, v = _inputs(8)
  rng = np.random.default_rng(9)
  bias = rng.standard_normal((4, 9, 12))
  sinks = rng.standard_normal((4,))
  with jax.enable_x64(True):
    kw = dict(kwargs)
    if "segment_ids" in kw:
      kw["segment_ids"] = tuple(jnp.asarray(x) for x in kw["segment_ids"])

    def f(q, k, v, bias, sinks):
      out, lse = reference.attention(q, k, v, bias=bias, sinks=sinks,
                                     return_lse=True, precision="float64", **kw)
      return jnp.sum(out * jnp.cos(out)), jnp.where(jnp.isfinite(lse), lse, 0)

    args = tuple(np.asarray(x, np.float64) for x in (q, k, v, bias, sinks))
    check_grads(lambda *a: f(*a)[0], args, order=1, modes=["rev"], atol=1e-6,
                rtol=1e-6)
    check_grads(lambda *a: f(*a)[1], args, order=1, modes=["rev"], atol=1e-6,
                rtol=1e-6)
