"""Which platform ``flash_mha_with_kvcache`` runs, and what it says about it (the
numbers are the conformance suite's: common/conformance_kvcache.py)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import pallas_tpu, registry
from flashjax.common import conformance_kvcache


def _arrays(head_dim=32):
  arrays, static = conformance_kvcache.make_kv_inputs(conformance_kvcache.KvCase(
      seq_q=2, seq_new=1, causal=True, page_size=8, capacity=24, head_dim=head_dim,
      seed=1))
  return {**arrays, **static}


def test_gpu_without_a_kernel_for_the_call_runs_xla_and_says_so_once(caplog,
                                                                     monkeypatch):
  monkeypatch.setattr(registry, "_logged", set())
  a = _arrays(head_dim=48)
  want = flashjax.flash_mha_with_kvcache(**a, backend="cpu")
  with caplog.at_level(logging.WARNING, logger="flashjax"):
    for platform in (None, None, "triton"):
      got = flashjax.flash_mha_with_kvcache(**a, backend="gpu", platform=platform)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  msgs = [r.getMessage() for r in caplog.records]
  # The GPU kernel's tiles take power-of-two head dims.
  assert len(msgs) == 2, msgs
  assert "skipped: pallas-triton kvcache: head dims 48/48" in msgs[0]
  assert "no triton kernel yet; running the xla path" in msgs[1]


def test_gpu_kernel_runs_where_it_applies(monkeypatch):
  from flashjax.pallas_gpu.triton import kvcache as triton_kvcache
  calls = []
  real = triton_kvcache.attention
  monkeypatch.setattr(triton_kvcache, "attention",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  arrays, static = conformance_kvcache.make_kv_inputs(conformance_kvcache.KvCase(
      seq_q=2, seq_new=1, causal=True, page_size=16, capacity=48, seed=2))
  a = {**arrays, **static}
  got = flashjax.flash_mha_with_kvcache(**a, backend="gpu", platform="pallas-triton",
                                        interpret=True)
  assert calls == [1]
  np.testing.assert_allclose(np.asarray(got),
                             np.asarray(flashjax.flash_mha_with_kvcache(**a)),
                             atol=2e-5, rtol=2e-5)


def test_tpu_runs_the_kernel_and_falls_back_for_what_it_lacks(caplog, monkeypatch):
  monkeypatch.setattr(registry, "_logged", set())
  calls = []
  real = pallas_tpu.kvcache_attention
  monkeypatch.setattr(pallas_tpu, "kvcache_attention",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  a = _arrays()
  flashjax.flash_mha_with_kvcache(**a, backend="tpu", interpret=True)
  assert calls == [1]
  wide = _arrays(head_dim=320)  # past the kernel's VMEM tiles
  with caplog.at_level(logging.WARNING, logger="flashjax"):
    out = flashjax.flash_mha_with_kvcache(**wide, backend="tpu", interpret=True)
  assert calls == [1]
  np.testing.assert_array_equal(
      np.asarray(out), np.asarray(flashjax.flash_mha_with_kvcache(**wide)))
  assert "skipped: pallas-tpu: head dim 320" in caplog.text


@pytest.mark.parametrize("kw,error", [
    (dict(platform="xla", interpret=True), ValueError),
    (dict(backend="cpu", interpret=True), ValueError),
    (dict(backend="cpu", platform="triton"), NotImplementedError),
    (dict(backend="tpu", platform="nope"), ValueError),
])
def test_platform_errors(kw, error):
  with pytest.raises(error):
    flashjax.flash_mha_with_kvcache(**_arrays(), **kw)


def test_return_forms():
  a = _arrays()
  out, lse, k_cache, v_cache = flashjax.flash_mha_with_kvcache(
      **a, return_softmax_lse=True, return_updated_cache=True)
  forms = {(False, False): (out,), (True, False): (out, lse),
           (False, True): (out, k_cache, v_cache)}
  for (with_lse, with_cache), want in forms.items():
    got = flashjax.flash_mha_with_kvcache(**a, return_softmax_lse=with_lse,
                                          return_updated_cache=with_cache)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for x, y in zip(got, want):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert out.shape == a["q"].shape and lse.shape == (2, 2, 2)
  # The appended keys differ from what the slots held before.
  assert not np.array_equal(np.asarray(k_cache), np.asarray(a["k_cache"]),
                            equal_nan=True)


def test_chained_decode_layers_lower_the_kernel_once():
  # common.platform.traced_once: a decode step of many layers lowers its kernel
  # once; inline, four layers lowered four copies.
  q = jax.ShapeDtypeStruct((2, 1, 4, 16), jnp.float32)
  cache = jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32)
  seqlens = jax.ShapeDtypeStruct((2,), jnp.int32)

  def size(layers):
    def step(q, k_cache, v_cache, cache_seqlens):
      for _ in range(layers):
        q = flashjax.flash_mha_with_kvcache(q, k_cache, v_cache,
                                            cache_seqlens=cache_seqlens,
                                            is_causal=True, platform="xla")
      return q
    return len(jax.jit(step).lower(q, cache, cache, seqlens).as_text())

  one, four = size(1), size(4)
  assert four < 1.3 * one, (one, four)
