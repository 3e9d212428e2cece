"""Proves the conformance suite works, on a throwaway dense implementation.

The implementation below is written independently of the reference (no shared
helpers except canonicalisation) and is not a platform; it only shows that the
suite passes a correct implementation, demands errors for declared gaps, and fails
wrong ones.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import conformance, dropout, spec as spec_lib


def dense_attention(q, k, v, *, causal_shift=0, **kwargs):
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  if spec.num_sinks:
    raise NotImplementedError("dense test implementation: no sinks")
  if max(spec.head_dim, spec.head_dim_v) > 256:
    raise NotImplementedError(f"dense test implementation: head dim {spec.head_dim}")
  f32 = jnp.float32
  g = spec.group_size
  qf = ops.q.astype(f32).reshape(spec.batch, spec.seq_q, spec.heads_kv, g, -1)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, ops.k.astype(f32),
                 precision="highest").reshape(spec.batch, spec.heads_q, spec.seq_q,
                                              spec.seq_k) * spec.softmax_scale
  if ops.bias is not None:
    s = s + ops.bias
  if spec.logits_soft_cap:
    s = spec.logits_soft_cap * jnp.tanh(s / spec.logits_soft_cap)
  i = jnp.arange(spec.seq_q)[:, None] + spec.seq_k - spec.seq_q
  j = jnp.arange(spec.seq_k)[None, :]
  ok = jnp.ones((spec.seq_q, spec.seq_k), bool)
  if spec.band.left is not None:
    ok &= j >= i - spec.band.left
  if spec.band.right is not None:
    ok &= j <= i + spec.band.right + causal_shift
  ok = ok[None, None]
  if ops.q_segment_ids is not None:
    ok = ok & (ops.q_segment_ids[:, None, :, None] == ops.kv_segment_ids[:, None, None])
  if ops.mask is not None:
    ok = ok & ops.mask
  s = jnp.where(ok, s, -1e30)
  m = jnp.max(s, -1, keepdims=True)
  p = jnp.where(ok, jnp.exp(s - m), 0)
  l = p.sum(-1, keepdims=True)
  # Empty rows divide by 1, not a tiny clamp: the jvp of x / y has y**-2 in it.
  empty = l[..., 0] == 0
  l = jnp.where(l > 0, l, 1.0)
  lse = jnp.where(empty, -jnp.inf, (m + jnp.log(l))[..., 0])
  p = p / l
  if spec.dropout_rate:
    bi, hi, qi, ki = jnp.ix_(*(jnp.arange(n) for n in p.shape))
    keep = dropout.keep(ops.dropout_seed, bi, hi, qi, ki, spec.dropout_rate)
    p = jnp.where(keep, p / (1 - spec.dropout_rate), 0)
  vf = jnp.repeat(ops.v.astype(f32), g, axis=2)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision="highest").astype(q.dtype)
  return (out, lse) if spec.return_lse else out


class TestDenseSelfTest(conformance.ConformanceSuite):
  # Up to 400 tokens: the suite's 1000-token cases pass on the xla instances,
  # whose numbers come from another implementation than this one.
  CAPS = conformance.Capabilities(
      name="dense-selftest",
      features=frozenset(conformance.FEATURES) - {"sinks"},
      head_dim_ok=lambda d: d <= 256, max_seq_len=400, hypothesis_examples=6)
  # Every check but the shape, dtype and head-dim sweeps: those run on every
  # platform instance against the reference, and here cost a third of this
  # instance's CI time (37 of 102 s, 2026-11-28) without a check of their own.
  SUBSET = frozenset(
      n for n in dir(conformance.ConformanceSuite) if n.startswith("test_")) - {
          "test_shapes", "test_dtypes", "test_head_dims"}

  def attention(self, q, k, v, **kwargs):
    return dense_attention(q, k, v, **kwargs)


class _Broken(conformance.ConformanceSuite):
  CAPS = conformance.Capabilities(name="broken")

  def __init__(self, fn):
    self.fn = fn

  def attention(self, q, k, v, **kwargs):
    return self.fn(q, k, v, **kwargs)


@pytest.mark.parametrize("name,fn,case", [
    ("causal off by one", lambda *a, **kw: dense_attention(*a, causal_shift=1, **kw),
     conformance.Case(causal=True)),
    ("wrong scale", lambda q, k, v, **kw: dense_attention(
        q, k, v, **{**kw, "softmax_scale": 0.1}), conformance.Case()),
    ("ignores dropout seed", lambda q, k, v, **kw: dense_attention(
        q, k, v, **{**kw, "dropout_seed": 0}), conformance.Case(dropout_rate=0.3)),
    ("lse off", lambda *a, **kw: jax.tree.map(lambda x: x + 1e-3 * (x.ndim == 3),
                                              dense_attention(*a, **kw)),
     conformance.Case()),
    ("claims sinks", dense_attention, conformance.Case(sinks=1)),
])
def test_suite_fails_wrong_implementations(name, fn, case):
  with pytest.raises((AssertionError, NotImplementedError)):
    _Broken(fn).check(case)


def test_suite_demands_error_for_declared_gap():
  suite = _Broken(dense_attention)
  object.__setattr__(suite, "CAPS", conformance.Capabilities(
      name="no-bias", features=frozenset(conformance.FEATURES) - {"bias"}))
  # dense_attention does bias, so a platform claiming it does not must fail.
  with pytest.raises(BaseException, match="DID NOT RAISE"):
    suite.check(conformance.Case(bias_shape=(-1, -1)))


def test_assert_matches_checks_both_the_one_device_call_and_the_reference():
  from flashjax.common import tolerances
  tol = tolerances.forward("bfloat16")
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
  tolerances.assert_matches(x, x + 1e-4, x - 1e-4, tol, name="out")
  with pytest.raises(AssertionError, match="out vs one device"):
    tolerances.assert_matches(x, x + 0.5, x, tol, name="out")
  with pytest.raises(AssertionError, match="out vs ref"):
    tolerances.assert_matches(x, x, x + 0.5, tol, name="out")


def test_second_run_must_be_bit_identical_on_a_device(monkeypatch):
  """An implementation whose runs differ (as a race would make them) fails where
  the suite runs on a device; on the CPU, whose platforms run serially, the
  suite does not run it twice."""
  from jax.experimental import io_callback
  runs = []

  def tick():
    runs.append(None)
    return np.float32(len(runs) - 1)

  def drifting(q, k, v, **kwargs):
    out, lse = dense_attention(q, k, v, **kwargs)
    drift = io_callback(tick, jax.ShapeDtypeStruct((), jnp.float32), ordered=True)
    return out + 1e-6 * drift, lse

  suite = _Broken(drifting)
  object.__setattr__(suite, "CAPS", conformance.Capabilities(
      name="drifting", features=frozenset(conformance.FEATURES) - {"sinks"}))
  suite.check(conformance.Case())
  assert runs == [None]
  monkeypatch.setattr(conformance.jax, "default_backend", lambda: "gpu")
  with pytest.raises(AssertionError, match="differs between two runs"):
    suite.check(conformance.Case())


@pytest.mark.parametrize("size,passes", [(1e-9, True), (1.0, False)])
def test_a_gradient_that_may_vary_must_still_agree_to_rounding(monkeypatch, size,
                                                               passes):
  """A gradient named by ``may_vary`` (atomic adds in no fixed order) may
  differ between two runs by rounding, not by more: dq drifts between runs by
  ``size`` times the sum of dO, outputs stay bit-identical."""
  from jax.experimental import io_callback
  runs = []

  def tick():
    runs.append(None)
    return np.float32(len(runs) - 1)

  def drifting_dq(q, k, v, **kwargs):
    res = dense_attention(q, k, v, **kwargs)
    drift = io_callback(tick, jax.ShapeDtypeStruct((), jnp.float32))
    term = drift * size * jnp.sum(q.astype(jnp.float32))
    zero = term - jax.lax.stop_gradient(term)  # 0 in value, drift in dq
    out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    out = (out.astype(jnp.float32) + zero).astype(out.dtype)
    return (out, *rest) if rest else out

  class Varying(_Broken):
    def may_vary(self, case):
      return frozenset({"q"})

  for cls, ok in ((Varying, passes), (_Broken, False)):
    suite = cls(drifting_dq)
    object.__setattr__(suite, "CAPS", conformance.Capabilities(
        name="drifting-dq", features=frozenset(conformance.FEATURES) - {"sinks"}))
    monkeypatch.setattr(conformance.jax, "default_backend", lambda: "gpu")
    if ok:
      suite.check(conformance.Case())
    else:
      with pytest.raises(AssertionError, match="dq differs between two runs"):
        suite.check(conformance.Case())


class _Item:
  def __init__(self, cls, name):
    self.cls, self.originalname = cls, name


def test_a_subset_instance_keeps_only_its_tests_and_names_real_ones():
  class Part(conformance.ConformanceSuite):
    SUBSET = frozenset({"test_shapes"})

  items = [_Item(Part, "test_shapes"), _Item(Part, "test_bias"),
           _Item(TestDenseSelfTest, "test_bias"), _Item(None, "test_free")]
  keep, drop = conformance.split_by_subset(items)
  assert keep == [items[0], items[2], items[3]] and drop == [items[1]]

  class Typo(conformance.ConformanceSuite):
    SUBSET = frozenset({"test_shape"})

  with pytest.raises(ValueError, match=r"Typo.SUBSET names no test: \['test_shape'\]"):
    conformance.split_by_subset([_Item(Typo, "test_shapes")])
