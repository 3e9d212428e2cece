"""The compat entry points against the libraries' own meaning: ``dot_product_attention``
against ``jax.nn.dot_product_attention`` (its XLA path, top-left alignment), the
lucidrains entries against flashjax's reference, called as that library's README
calls them, flash-attn3-jax's ``seqused_k`` and jax-flash-attn2's ``FORCE_MHA``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import api
from flashjax.compat import lucidrains
from flashjax.common import reference

TOL = dict(atol=2e-5, rtol=2e-5)


def _qkv(b, t, s, n, kh, h, seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
  return q, k, v, jax.random.normal(ks[3], (b, t, n, h), dtype)


def _visible(b, n, t, s, is_causal, window, q_len, kv_len):
  """Rows of jax.nn's result that see at least one key (elsewhere jax.nn gives
  the mean of the values, flashjax 0)."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  m = np.ones((t, s), bool)
  if is_causal:
    m &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    m &= (i - left <= j) & (j <= i + right)
  m = np.broadcast_to(m, (b, t, s)).copy()
  if kv_len is not None:
    m &= np.arange(s)[None, None, :] < np.asarray(kv_len)[:, None, None]
  rows = m.any(-1)
  if q_len is not None:
    rows &= np.arange(t)[None, :] < np.asarray(q_len)[:, None]
  return rows  # [b, t]


CASES = [
    dict(t=16, s=40, is_causal=True, grad=True),
    dict(t=40, s=16, is_causal=True, window=3),
    dict(t=16, s=40, window=(5, 2)),
    dict(t=30, s=30, window=(0, 4), q_len=[30, 11], kv_len=[17, 30]),
    dict(t=20, s=28, bias=True, mask=True, is_causal=True, kv_len=[28, 9], grad=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dot_product_attention_matches_jax_nn(case):
  b, n, kh, h = 2, 4, 2, 16
  t, s = case["t"], case["s"]
  q, k, v, do = _qkv(b, t, s, n, kh, h)
  kw = dict(is_causal=case.get("is_causal", False),
            local_window_size=case.get("window"))
  r = np.random.default_rng(0)
  if case.get("bias"):
    kw["bias"] = jnp.asarray(r.normal(size=(1, n, t, s)), jnp.float32)
  if case.get("mask"):
    kw["mask"] = jnp.asarray(r.random((b, 1, t, s)) < 0.8)
  for name in ("q_len", "kv_len"):
    if name in case:
      kw["query_seq_lengths" if name == "q_len" else "key_value_seq_lengths"] = (
          jnp.asarray(case[name], jnp.int32))

  # jax.nn's residual carries no gradient, so the loss is the output's alone.
  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, **kw) * do)

  rows = _visible(b, n, t, s, kw["is_causal"], kw["local_window_size"],
                  case.get("q_len"), case.get("kv_len"))
  ours = jax.jit(lambda q, k, v: flashjax.dot_product_attention(
      q, k, v, return_residual=True, **kw))(q, k, v)
  want = jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                      return_residual=True, **kw)
  np.testing.assert_allclose(ours[0][rows], want[0][rows], **TOL)
  np.testing.assert_allclose(ours[1][rows], want[1][rows], **TOL)
  assert np.all(np.asarray(ours[0])[~rows] == 0)
  assert np.all(np.isneginf(np.asarray(ours[1])[~rows]))
  if case.get("grad"):
    g_ours = jax.jit(jax.grad(lambda *a: loss(flashjax.dot_product_attention, *a),
                              argnums=(0, 1, 2)))(q, k, v)
    g_want = jax.jit(jax.grad(lambda *a: loss(
        lambda *x, **y: jax.nn.dot_product_attention(*x, implementation="xla", **y),
        *a), argnums=(0, 1, 2)))(q, k, v)
    for a, w in zip(g_ours, g_want):
      np.testing.assert_allclose(a, w, atol=5e-5, rtol=5e-5)


def test_dot_product_attention_rank3_and_platform_list():
  q, k, v, _ = _qkv(1, 12, 20, 2, 1, 8, seed=1)
  want = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
  out = flashjax.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                       implementation=["triton", "xla"])
  assert out.shape == q[0].shape
  np.testing.assert_allclose(out, want, **TOL)
  out = flashjax.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                       implementation="pallas-triton",
                                       backend="gpu", interpret=True)
  np.testing.assert_allclose(out, want, **TOL)


@pytest.mark.parametrize("kw, match", [
    (dict(implementation="cudnn"), "jax.nn's own kernel"),
    (dict(implementation=[]), "implementation must be"),
    (dict(local_window_size=-2), "local_window_size must be >= 0"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size must be None"),
    (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), "query_seq_lengths must"),
    (dict(is_causal=1), "is_causal must be a bool"),
])
def test_dot_product_attention_errors(kw, match):
  q, k, v, _ = _qkv(2, 8, 8, 2, 2, 8)
  with pytest.raises(ValueError, match=match):
    flashjax.dot_product_attention(q, k, v, **kw)


def test_dot_product_attention_list_reports_every_reason():
  q, k, v, _ = _qkv(1, 8, 8, 2, 2, 8)
  with pytest.raises(NotImplementedError, match="triton.*\n.*pallas-triton"):
    flashjax.dot_product_attention(q, k, v, implementation=["triton", "pallas-triton"],
                                   backend="cpu")


def test_lucidrains_readme_calls():
  rng_key = jax.random.PRNGKey(42)
  q = jax.random.normal(rng_key, (1, 2, 96, 32))  # (batch, heads, seq, dim)
  k = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 96, 32))
  v = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 96, 32))
  mask = jax.random.randint(rng_key, (1, 96,), 0, 2)  # (batch, seq)
  out, lse = lucidrains.flash_attention(q, k, v, mask)
  assert out.shape == (1, 2, 96, 32) and lse.shape == (1, 2, 96)
  np.testing.assert_allclose(out, lucidrains.plain_attention(q, k, v, mask), **TOL)

  diff, (dq, dk, dv) = lucidrains.value_and_grad_difference(
      lucidrains.plain_attention, lucidrains.flash_attention, seed=42, batch=2,
      heads=2, q_seq_len=48, k_seq_len=80, dim=16)
  assert float(diff) < 1e-3 and max(float(dq), float(dk), float(dv)) < 1e-4

  q = jax.random.normal(rng_key, (3, 64, 16))  # leading axes, seq, dim
  k = jax.random.normal(jax.random.PRNGKey(3), (3, 64, 16))
  v = jax.random.normal(jax.random.PRNGKey(4), (3, 64, 16))
  out, lse = lucidrains.causal_flash_attention(q, k, v)
  assert out.shape == (3, 64, 16) and lse.shape == (3, 64)
  want = reference.attention(q[None].swapaxes(1, 2), k[None].swapaxes(1, 2),
                             v[None].swapaxes(1, 2), causal=True)
  np.testing.assert_allclose(out, want[0].swapaxes(0, 1), **TOL)


def test_flash_mha_varlen_seqused_k():
  """Sequence s attends to its first seqused_k[s] keys only, its band aligned to
  that length (causal: the q rows on their keys' rows; else the packed rows
  directly); a sequence with no used key outputs 0; unused keys get no
  gradient."""
  lens_q, lens_k, used = [3, 6, 2], [7, 6, 4], [5, 0, 4]
  tq, tk = sum(lens_q) + 2, sum(lens_k) + 1
  ks = jax.random.split(jax.random.key(21), 3)
  q = jax.random.normal(ks[0], (tq, 2, 16))
  k = jax.random.normal(ks[1], (tk, 1, 16))
  v = jax.random.normal(ks[2], (tk, 1, 16))
  cu_q = jnp.array(np.cumsum([0] + lens_q), jnp.int32)
  cu_k = jnp.array(np.cumsum([0] + lens_k), jnp.int32)
  used_k = jnp.array(used, jnp.int32)  # closed over: concrete under jit, as eagerly
  run = lambda q, k, v, causal: flashjax.flash_mha_varlen(
      q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=causal,
      seqused_k=used_k)

  # The reference compiled once per shape (eager, each of its operations compiles).
  ref = jax.jit(reference.attention, static_argnames="causal")

  def check(out, causal):
    a = b = 0
    for nq, nk, n in zip(lens_q, lens_k, used):
      want = jnp.zeros_like(q[a:a + nq]) if n == 0 else ref(
          q[None, a:a + nq], k[None, b:b + n], v[None, b:b + n], causal=causal)[0]
      np.testing.assert_allclose(out[a:a + nq], want, **TOL)
      a, b = a + nq, b + nk
    assert np.all(np.asarray(out[a:]) == 0)

  check(jax.jit(run, static_argnums=3)(q, k, v, False), False)
  out, vjp = jax.vjp(jax.jit(lambda q, k, v: run(q, k, v, True)), q, k, v)
  check(out, True)
  _, dk, dv = vjp(jnp.ones_like(out))
  unused = np.ones(tk, bool)
  for start, n in zip(np.cumsum([0] + lens_k), used):
    unused[start:start + n] = False
  assert np.all(np.asarray(dk)[unused] == 0) and np.all(np.asarray(dv)[unused] == 0)
  assert np.all(np.any(np.asarray(dv)[~unused] != 0, axis=(1, 2)))
  with pytest.raises(ValueError, match="seqused_k must lie between 0"):
    flashjax.flash_mha_varlen(q, k, v, cu_q, cu_k, 6, 7,
                              seqused_k=jnp.array([8, 0, 4], jnp.int32))
  with pytest.raises(ValueError, match="seqused_k must be a 1-D int array of 3"):
    flashjax.flash_mha_varlen(q, k, v, cu_q, cu_k, 6, 7,
                              seqused_k=jnp.array([5, 0], jnp.int32))


def test_force_mha_is_read_by_jax_flash_attn2_entry_only(monkeypatch):
  """FORCE_MHA=1 repeats K/V heads in get_cached_flash_attention's callable (the
  platform sees as many kv heads as q heads); the contract's entry ignores it."""
  seen = []

  def spy(ops, spec, **kw):  # the platform's place: the reference, densely
    seen.append(spec.heads_kv)
    return reference.attention_from_operands(ops, spec)

  monkeypatch.setattr(api, "dispatch", spy)
  monkeypatch.setenv("FORCE_MHA", "1")
  q, k, v, _ = _qkv(1, 24, 24, 4, 2, 16, seed=5)
  cached = flashjax.get_cached_flash_attention(backend="cpu", platform="xla")
  np.testing.assert_allclose(cached(q, k, v, causal=True),
                             reference.attention(q, k, v, causal=True), **TOL)
  flashjax.flash_attention(q, k, v, causal=True)
  monkeypatch.delenv("FORCE_MHA")
  cached(q, k, v, causal=True)
  assert seen == [4, 2, 2]


def test_flash_mha_varlen_promises_runs_only_where_its_ids_fit(monkeypatch):
  """flash_mha_varlen promises contiguous segments for its sequences, but not
  with more sequences than rows (empty sequences number ids past the rows,
  outside the promise's range) or with seqused_k (unused rows inside
  sequences); either call runs and matches the reference."""
  from flashjax import api
  from flashjax.common import reference
  seen = []
  call = api.flash_attention
  monkeypatch.setattr(api, "flash_attention", lambda *a, **kw: (
      seen.append(kw.get("contiguous_segments")), call(*a, **kw))[1])
  x = jax.random.normal(jax.random.key(3), (6, 2, 16))
  for cu, expect in (([0, 2, 6], True), ([0, 1, 1, 1, 1, 1, 1, 2], False)):
    cu = jnp.asarray(cu, jnp.int32)
    out = flashjax.flash_mha_varlen(x, x, x, cu, cu, 4, 4)
    assert seen[-1] is expect
    ids = jnp.searchsorted(cu[1:], jnp.arange(6), side="right")
    ids = jnp.where(jnp.arange(6) < cu[-1], ids, -1)[None]
    kv = jnp.where(ids < 0, -2, ids)
    ref = reference.attention(x[None], x[None], x[None], segment_ids=(ids, kv))[0]
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_flash_mha_varlen_row_sequences_by_compare_by_scatter_and_on_the_host(
    monkeypatch):
  """A packed row's sequence number, computed by comparing it with the offsets
  (few sequences), by a scatter and prefix sum (many) and on the host (concrete
  offsets), is each row's sequence as the offsets lay them out: with empty
  sequences, offsets at the total, padding rows, with and without seqused_k."""
  from flashjax.compat import flash_attn_jax as fa
  rng = np.random.default_rng(5)
  default = fa.COMPARE_OFFSETS
  cases = [(np.array(c, np.int32), t) for c, t in (
      ([0, 3, 9, 9], 9), ([0, 0, 4, 9, 9], 12), ([0, 5], 5), ([0], 4))]
  for n_seq, total in ((3, 40), (9, 64), (30, 50)):
    cuts = np.sort(rng.integers(0, total + 1, n_seq - 1))
    end = int(rng.integers(cuts[-1], total + 1))
    cases.append((np.concatenate([[0], cuts, [end]]).astype(np.int32), total))
  for cu, total in cases:
    lens = np.diff(cu)
    for used in (None, rng.integers(0, lens + 1).astype(np.int32)):
      # Brute force: sequence s holds rows cu[s]:cu[s+1], its first used[s] real.
      want = np.full(total, -1)
      for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        want[a:b if used is None else a + used[s]] = s
      got = [fa._cu_to_ids(cu, total, -1, used)]
      for limit in (default, -1):
        monkeypatch.setattr(fa, "COMPARE_OFFSETS", limit)
        jused = None if used is None else jnp.asarray(used)
        got.append(fa._cu_to_ids(jnp.asarray(cu), total, -1, jused))
        got.append(jax.jit(lambda c, u: fa._cu_to_ids(c, total, -1, u))(cu, used))
      assert isinstance(got[0], np.ndarray) and got[0].dtype == np.int32
      for ids in got:
        np.testing.assert_array_equal(ids, want, err_msg=f"{cu} {used}")


def test_eager_flash_mha_varlen_checks_its_promise_on_host_ids(monkeypatch):
  """Eager flash_mha_varlen (concrete offsets) builds its ids on the host, so
  the promise's check reads them without copying ids back from the device;
  under jit they are traced and go unchecked."""
  from flashjax.common import spec as spec_lib
  seen = []
  check = spec_lib.check_contiguous_segments
  monkeypatch.setattr(spec_lib, "check_contiguous_segments", lambda ids: (
      seen.append([type(x) for x in ids]), check(ids))[1])
  x = jax.random.normal(jax.random.key(4), (10, 2, 16))
  cu = jnp.asarray([0, 3, 8], jnp.int32)
  eager = flashjax.flash_mha_varlen(x, x, x, cu, cu, 5, 5, is_causal=True)
  assert seen and all(t is np.ndarray for types in seen for t in types), seen
  seen.clear()
  jitted = jax.jit(lambda x, cu: flashjax.flash_mha_varlen(
      x, x, x, cu, cu, 5, 5, is_causal=True))(x, cu)
  assert seen and all(issubclass(t, jax.core.Tracer) for types in seen
                      for t in types), seen
  np.testing.assert_allclose(eager, jitted, rtol=1e-6, atol=1e-6)
