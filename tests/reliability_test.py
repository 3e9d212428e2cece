"""Bad input gets a clear error naming the argument, ambiguous input is refused
rather than guessed, and valid calls that used to fail run: the frontend's share
of the reliability contract (sharding: sharding_test.py; x64 and platform
behaviour: common/conformance_x64.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax.common import compat, conformance_x64, reference, tolerances

TOL = tolerances.forward("float32")


def _qkv(b=2, sq=16, sk=16, hq=2, hkv=1, d=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, sq, hq, d)),
          jax.random.normal(ks[1], (b, sk, hkv, d)),
          jax.random.normal(ks[2], (b, sk, hkv, d)))


def _close(x, ref, name="out"):
  tolerances.assert_close(np.asarray(x, np.float32), np.asarray(ref), TOL, name=name)


# -- flash_mha_varlen ------------------------------------------------------------


@pytest.mark.parametrize("cu,match", [
    ([0, 15, 10, 24], "non-decreasing"),
    ([3, 10, 24], "must start at 0"),
    ([0, 10, 30], "past the 24 packed rows"),
])
def test_varlen_rejects_bad_offsets(cu, match):
  x = jnp.ones((24, 2, 16))
  with pytest.raises(ValueError, match=f"cu_seqlens_q .*{match}|{match}"):
    flashjax.flash_mha_varlen(x, x, x, jnp.array(cu), jnp.array(cu), 15, 15)


def test_varlen_accepts_integer_scalar_max_seqlen():
  r = np.random.default_rng(0)
  x = jnp.asarray(r.normal(size=(24, 2, 16)), jnp.float32)
  cu = jnp.array([0, 10, 24], jnp.int32)
  run = lambda m_q, m_k: jax.jit(lambda x: flashjax.flash_mha_varlen(
      x, x, x, cu, cu, m_q, m_k))(x)
  np.testing.assert_array_equal(np.asarray(run(np.int64(14), jnp.int32(14))),
                                np.asarray(run(14, 14)))
  with pytest.raises(ValueError, match="max_seqlen_q must be a positive int"):
    flashjax.flash_mha_varlen(x, x, x, cu, cu, 14.0, 14)


# -- get_cached_flash_attention's 2-D mask -----------------------------------------


def test_two_dim_mask_is_never_misread():
  cached = flashjax.get_cached_flash_attention(backend="cpu", platform="xla")
  attention = jax.jit(lambda q, k, v, m: cached(q, k, v, attention_mask=m))
  tri = jnp.tri(16, dtype=bool)
  q16 = jnp.ones((16, 16, 1, 8))
  with pytest.raises(ValueError, match=r"ambiguous.*\[B, 1, 1, Sk\]"):
    attention(q16, q16, q16, tri)
  # B != Sq: [Sq, Sk] is a mask for every batch element ([B, Sk] key padding is
  # checked in frontend_test).
  q, k, v = _qkv(b=2, sq=16, sk=16, seed=2)
  _close(attention(q, k, v, tri), reference.attention(q, k, v, mask=tri))


# -- static arguments and their messages -------------------------------------------


@pytest.mark.parametrize("name", ["softmax_scale", "dropout_rate", "logits_soft_cap"])
def test_array_valued_static_number_says_so(name):
  q, k, v = _qkv()
  kw = {"dropout_seed": 1} if name == "dropout_rate" else {}
  with pytest.raises(ValueError, match=f"{name} must be a Python number"):
    flashjax.flash_attention(q, k, v, **{name: jnp.float32(0.1)}, **kw)
  with pytest.raises(ValueError, match=f"{name} must be a Python number"):
    jax.jit(lambda x: flashjax.flash_attention(q, k, v, **{name: x}, **kw))(0.1)


def test_window_and_block_size_messages(monkeypatch):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"window_size must be a \(left, right\) pair"):
    flashjax.flash_mha(q, k, v, window_size=5)
  with pytest.raises(ValueError, match="blocksize_q must be a positive int"):
    flashjax.get_cached_flash_attention(blocksize_q=[128])
  monkeypatch.setenv("BLOCKSIZE_M_FLASH_ATTN", "abc")
  with pytest.raises(ValueError, match="BLOCKSIZE_M_FLASH_ATTN must be a positive int"):
    # A block size no other test asks for: the callable is built, not cached.
    flashjax.get_cached_flash_attention(backend="cpu", platform="xla", blocksize_k=208)


def test_every_platform_reason_is_reported():
  q = jnp.ones((1, 8, 1, 512))
  with pytest.raises(NotImplementedError) as e:
    flashjax.flash_attention(q, q, q, backend="tpu", interpret=True)
  assert "pallas-tpu: head dim 512 > 256" in str(e.value)
  assert "xla: has no interpret mode" in str(e.value)


# -- transformations ------------------------------------------------------------------


def test_vmap_of_tpu_interpret():
  q = jax.random.normal(jax.random.key(3), (2, 1, 16, 2, 16))
  f = lambda x: flashjax.flash_attention(x, x, x, causal=True, backend="tpu",
                                         platform="pallas", interpret=True)
  ref = lambda x: reference.attention(x, x, x, causal=True)
  _close(jax.jit(jax.vmap(f))(q), jax.vmap(ref)(q))


def test_wide_segment_ids_with_key_padding_stay_distinct():
  q, k, v = _qkv(sq=16, sk=16, seed=4)
  ids = jnp.repeat(jnp.arange(2), 8)[None].repeat(2, 0)  # two segments of 8
  kpm = jnp.arange(16)[None] < jnp.array([[12], [16]])
  want = reference.attention(q, k, v, segment_ids=(ids, ids),
                             mask=kpm[:, None, None, :])
  with compat.enable_x64():
    wide = ids.astype(jnp.int64) * conformance_x64.WIDE  # 0 and 2**32
    got = jax.jit(lambda q, k, v, ids: flashjax.flash_attention(
        q, k, v, segment_ids=(ids, ids), key_padding_mask=kpm))(q, k, v, wide)
  _close(got, want)
