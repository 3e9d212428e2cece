"""The KV-cache semantics (common/kvcache.py and the reference's KV-cache form)
against a plain numpy loop written from the stated rules, and its input checks."""

import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import kvcache, reference, tolerances


def _rotate_np(x, cos, sin, pos, interleaved):
  """One vector ``x [D]`` at one position, pair by pair."""
  x = x.astype(np.float64).copy()
  half = cos.shape[1]
  for j in range(half):
    a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
    c, s = cos[pos, j], sin[pos, j]
    x[a], x[b] = x[a] * c - x[b] * s, x[a] * s + x[b] * c
  return x


def _naive(q, kc, vc, k, v, lens, pad, where, cos, sin, interleaved, causal, window,
           cap, sinks, scale):
  """Output and lse by the stated rules, one query and one position at a time.
  ``where(b, p)`` is the (row, slot) of position p of batch row b."""
  b_, sq, hq, d = q.shape
  hkv, s_new = kc.shape[2], 0 if k is None else k.shape[1]
  g = hq // hkv
  left, right = window
  right = 0 if causal and right == -1 else (min(right, 0) if causal else right)
  out = np.zeros(q.shape[:3] + (vc.shape[3],))
  lse = np.full((b_, hq, sq), -np.inf)
  for b in range(b_):
    total = lens[b] + s_new
    keys, vals = {}, {}
    for p in range(pad[b], total):
      if p < lens[b]:
        keys[p], vals[p] = kc[where(b, p)], vc[where(b, p)]
      else:
        keys[p], vals[p] = k[b, p - lens[b]], v[b, p - lens[b]]
        if cos is not None:
          keys[p] = np.stack([_rotate_np(keys[p][h], cos, sin, p - pad[b],
                                         interleaved) for h in range(hkv)])
    for h in range(hq):
      for i in range(sq):
        qv = q[b, i, h]
        if cos is not None:
          qpos = lens[b] - pad[b] + (i if causal or window != (-1, -1) else 0)
          qv = _rotate_np(qv, cos, sin, qpos, interleaved)
        diag = i + total - sq
        seen = [p for p in keys if (left == -1 or p >= diag - left) and (
            right == -1 or p <= diag + right)]
        logits = np.array([qv @ keys[p][h // g] for p in seen]) * scale
        if cap is not None:
          logits = cap * np.tanh(logits / cap)
        extra = [] if sinks is None else list(np.atleast_1d(sinks[h]))
        allv = np.concatenate([logits, extra])
        if not allv.size:
          continue
        m = allv.max()
        denom = np.exp(allv - m).sum()
        lse[b, h, i] = m + np.log(denom)
        if seen:
          out[b, i, h] = sum(np.exp(l - m) / denom * vals[p][h // g]
                             for l, p in zip(logits, seen))
  return out, lse


def _inputs(seed, *, paged):
  rng = np.random.default_rng(seed)
  b, sq, s_new, hq, hkv, d, dv = 3, 3, 2, 4, 2, 8, 6
  n = lambda *s: rng.standard_normal(s)
  q, k, v = n(b, sq, hq, d), n(b, s_new, hkv, d), n(b, s_new, hkv, dv)
  angles = rng.uniform(0, 6, (40, 3))
  cos, sin = np.cos(angles), np.sin(angles)
  lens, pad = np.array([10, 0, 5]), np.array([2, 0, 5])
  if paged:
    ps, max_pages = 3, 4
    kc, vc = n(14, ps, hkv, d), n(14, ps, hkv, dv)
    table = np.array([[3, 7, 1, 9], [0, 13, -1, -1], [12, 2, 5, 99]])
    kw = dict(page_table=jnp.asarray(table, jnp.int32))
    where = lambda bb, p: (table[bb, p // ps], p % ps)
  else:
    kc, vc = n(4, 12, hkv, d), n(4, 12, hkv, dv)
    idx = np.array([3, 0, 1])
    kw = dict(cache_batch_idx=jnp.asarray(idx, jnp.int32))
    where = lambda bb, p: (idx[bb], p)
  return (q, kc, vc, k, v, lens, pad, cos, sin), kw, where


@pytest.mark.parametrize("paged,interleaved,causal,window,cap,sinks", [
    (False, True, True, (-1, -1), None, None),
    (False, False, False, (-1, -1), 2.0, [0.5, 1.0, -1.0, 0.0]),
    (True, True, False, (3, 1), None, None),
    (True, False, True, (2, -1), 1.5, [0.3, 0.1, 2.0, -0.5]),
])
def test_reference_follows_the_stated_rules(paged, interleaved, causal, window, cap,
                                            sinks):
  (q, kc, vc, k, v, lens, pad, cos, sin), kw, where = _inputs(
      2 * paged + interleaved, paged=paged)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  out, lse, k_new, v_new = reference.attention_with_kvcache(
      f32(q), f32(kc), f32(vc), f32(k), f32(v),
      cache_seqlens=jnp.asarray(lens, jnp.int32),
      cache_leftpad=jnp.asarray(pad, jnp.int32), rotary_cos=f32(cos),
      rotary_sin=f32(sin), rotary_interleaved=interleaved, causal=causal,
      window_size=window, logits_soft_cap=cap,
      sinks=None if sinks is None else f32(sinks), **kw)
  r32 = lambda x: np.asarray(f32(x), np.float64)  # the same rounded inputs
  want_out, want_lse = _naive(r32(q), r32(kc), r32(vc), r32(k), r32(v), lens, pad,
                              where, r32(cos), r32(sin), interleaved, causal, window,
                              cap, None if sinks is None else r32(sinks),
                              1 / np.sqrt(q.shape[-1]))
  tol = tolerances.forward("float32")
  tolerances.assert_close(out, want_out, tol, name="out")
  tolerances.assert_close(lse, want_lse, tol, name="lse")
  if causal and sinks is None:  # row 1: 3 causal queries on 2 keys
    assert np.isinf(want_lse).any(), "the case should have rows that see nothing"
  # The append: rotated new keys at L_b.., every other slot unchanged.
  k_np, v_np = np.asarray(k_new, np.float64), np.asarray(v_new, np.float64)
  touched = np.zeros(k_np.shape[:2], bool)
  for b in range(q.shape[0]):
    for i in range(k.shape[1]):
      p = lens[b] + i
      slot = where(b, p)
      touched[slot] = True
      want = np.stack([_rotate_np(r32(k)[b, i, h], r32(cos), r32(sin), p - pad[b],
                                  interleaved) for h in range(k.shape[2])])
      np.testing.assert_allclose(k_np[slot], want, atol=1e-6)
      np.testing.assert_array_equal(v_np[slot], r32(v)[b, i])
  np.testing.assert_array_equal(k_np[~touched], r32(kc)[~touched])


def test_key_range_covers_exactly_the_allowed_positions():
  spec = kvcache.canonicalize(
      jnp.zeros((4, 3, 2, 8)), jnp.zeros((4, 20, 2, 8)), jnp.zeros((4, 20, 2, 8)),
      cache_seqlens=jnp.array([0, 5, 17, 20]), window_size=(4, 2))[1]
  total, pad = jnp.array([0, 5, 17, 20]), jnp.array([0, 2, 1, 12])
  lo, hi = kvcache.key_range(total, pad, spec)
  pos = np.arange(20)[None, None]
  row = np.arange(3)[None, :, None]
  ok = np.asarray(kvcache.key_allowed(pos, row, np.asarray(total)[:, None, None],
                                      np.asarray(pad)[:, None, None], spec))
  for b in range(4):
    seen = np.nonzero(ok[b].any(0))[0]
    if seen.size:
      assert (lo[b], hi[b]) == (seen.min(), seen.max() + 1)
    else:
      assert lo[b] >= hi[b]


@pytest.mark.parametrize("window", [(-1, -1), (4, 2), (-1, 0), (3, -1), (0, 0)])
def test_full_key_range_is_exactly_what_every_query_sees(window):
  seqlens = jnp.array([0, 2, 5, 17, 20, 20])
  spec = kvcache.canonicalize(
      jnp.zeros((6, 3, 2, 8)), jnp.zeros((6, 20, 2, 8)), jnp.zeros((6, 20, 2, 8)),
      cache_seqlens=seqlens, window_size=window)[1]
  total, pad = seqlens, jnp.array([0, 0, 2, 1, 12, 0])
  lo, hi = (np.asarray(x) for x in kvcache.full_key_range(total, pad, spec))
  pos = np.arange(20)[None, None]
  row = np.arange(3)[None, :, None]
  ok = np.asarray(kvcache.key_allowed(pos, row, np.asarray(total)[:, None, None],
                                      np.asarray(pad)[:, None, None], spec))
  for b in range(6):
    everyone = np.nonzero(ok[b].all(0))[0]
    if everyone.size:
      # Contiguous: no gap inside the range.
      assert (lo[b], hi[b]) == (everyone.min(), everyone.max() + 1)
      assert everyone.size == hi[b] - lo[b]
    else:
      assert lo[b] >= hi[b]


def _call(**over):
  q = jnp.zeros((2, 1, 4, 8))
  kw = dict(k_cache=jnp.zeros((2, 16, 2, 8)), v_cache=jnp.zeros((2, 16, 2, 8)),
            cache_seqlens=jnp.array([3, 16], jnp.int32))
  kw.update(over)
  return kvcache.canonicalize(q, kw.pop("k_cache"), kw.pop("v_cache"),
                              kw.pop("k", None), kw.pop("v", None), **kw)


@pytest.mark.parametrize("over,match", [
    (dict(cache_seqlens=jnp.array([3, 17], jnp.int32)), "cache_seqlens"),
    (dict(k=jnp.zeros((2, 1, 2, 8)), v=jnp.zeros((2, 1, 2, 8))), "cache_seqlens"),
    (dict(cache_leftpad=jnp.array([4, 0], jnp.int32)), "cache_leftpad"),
    (dict(cache_batch_idx=jnp.array([0, 2], jnp.int32)), "cache_batch_idx"),
    (dict(k_cache=jnp.zeros((5, 4, 2, 8)), v_cache=jnp.zeros((5, 4, 2, 8)),
          page_table=jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)),
     "page_table row 1"),
    (dict(k_cache=jnp.zeros((8, 4, 2, 8)), v_cache=jnp.zeros((8, 4, 2, 8)),
          page_table=jnp.zeros((2, 4), jnp.int32),
          cache_batch_idx=jnp.array([0, 1], jnp.int32)), "cache_batch_idx"),
    (dict(v_cache=jnp.zeros((2, 16, 1, 8))), "k_cache and v_cache"),
    (dict(k_cache=jnp.zeros((2, 16, 3, 8)), v_cache=jnp.zeros((2, 16, 3, 8))),
     "multiple"),
    (dict(k_cache=jnp.zeros((2, 16, 2, 8), jnp.bfloat16)), "k_cache must have"),
    (dict(k=jnp.zeros((2, 1, 2, 8))), "k and v"),
    (dict(rotary_cos=jnp.zeros((20, 4)), rotary_sin=jnp.zeros((20, 4))),
     "needs the new keys"),
    (dict(cache_seqlens=jnp.array([3, 12], jnp.int32), k=jnp.zeros((2, 2, 2, 8)),
          v=jnp.zeros((2, 2, 2, 8)), rotary_cos=jnp.zeros((13, 4)),
          rotary_sin=jnp.zeros((13, 4))), "rotary_cos/rotary_sin have 13"),
    (dict(num_splits=-1), "num_splits"),
    (dict(k_cache=jnp.zeros((3, 16, 2, 8)), v_cache=jnp.zeros((3, 16, 2, 8))),
     "cache_batch_idx"),
])
def test_bad_input_names_the_argument(over, match):
  with pytest.raises(ValueError, match=match):
    _call(**over)
