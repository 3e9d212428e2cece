"""The public API: every entry point against the reference, seed-style calls,
caching, platform choice and fall-through, explicit-platform errors, remat."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import api, registry
from flashjax.common import platform, reference, tolerances
from flashjax.common import spec as spec_lib

TOL = tolerances.forward("float32")
# Tests of the CPU backend's platform order, fall-through reasons and backend
# detection: on a GPU host the automatic choice differs and they do not apply.
CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu",
                              reason="asserts the CPU backend's platform choice")


# The reference compiled once per shape (eager, each of its operations compiles).
_reference = jax.jit(reference.attention, static_argnames=("causal",))


def _qkv(b=2, sq=96, sk=96, hq=4, hkv=2, d=32, seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, sq, hq, d), dtype),
          jax.random.normal(ks[1], (b, sk, hkv, d), dtype),
          jax.random.normal(ks[2], (b, sk, hkv, d), dtype))


def _close(x, ref, name="out"):
  tolerances.assert_close(np.asarray(x, np.float32), np.asarray(ref), TOL, name=name)


@pytest.mark.parametrize("kwargs", [
    {}, dict(causal=True), dict(sliding_window=(8, 8)), dict(logits_soft_cap=3.0),
    dict(sinks=jnp.linspace(-1, 1, 4)), dict(dropout_rate=0.2, dropout_seed=3),
    dict(bias=jnp.ones((96, 96)) * 0.3, mask=jnp.tri(96, dtype=bool)),
])
def test_flash_attention_matches_reference(kwargs):
  q, k, v = _qkv()
  out, lse = flashjax.flash_attention(q, k, v, return_lse=True, **kwargs)
  rout, rlse = reference.attention(q, k, v, return_lse=True, **kwargs)
  _close(out, rout)
  _close(lse, rlse, "lse")


def test_gradients_through_frontend():
  q, k, v = _qkv(seed=1)
  f = lambda fn: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, causal=True))),
                          argnums=(0, 1, 2))
  # flashjax's eagerly, as a user without jit would; the reference's compiled.
  for g, rg in zip(f(flashjax.flash_attention)(q, k, v),
                   jax.jit(f(reference.attention))(q, k, v)):
    tolerances.assert_close(g, rg, tolerances.grad("float32"), name="grad")


def test_key_padding_mask_equals_dense_mask():
  q, k, v = _qkv(seed=2)
  kpm = jnp.arange(96)[None, :] < jnp.array([[70], [96]])
  out = flashjax.flash_attention(q, k, v, key_padding_mask=kpm, causal=True)
  ref = reference.attention(q, k, v, mask=kpm[:, None, None, :], causal=True)
  _close(out, ref)
  with pytest.raises(ValueError, match="key_padding_mask must be bool"):
    flashjax.flash_attention(q, k, v, key_padding_mask=kpm.astype(jnp.int32))


def test_key_padding_combines_with_segment_ids():
  q, k, v = _qkv(seed=3)
  ids = (jnp.arange(96) // 40)[None].repeat(2, 0)
  kpm = jnp.arange(96)[None, :] < 90
  kpm = jnp.broadcast_to(kpm, (2, 96))
  out = flashjax.flash_attention(q, k, v, segment_ids=(ids, ids), key_padding_mask=kpm)
  ref = reference.attention(q, k, v, segment_ids=(ids, ids),
                            mask=kpm[:, None, None, :])
  _close(out, ref)


# -- seed-style calls, as written in the seeds' READMEs -------------------------------


def test_jax_flash_attn2_style():
  q, k, v = _qkv(seed=4)
  headdim = q.shape[-1]
  bias = jax.random.normal(jax.random.key(9), (2, 4, 96, 96))
  attention = flashjax.get_cached_flash_attention(
      backend="cpu", platform="jax", blocksize_q=64, blocksize_k=128,
      softmax_scale=headdim ** -0.5)
  outputs = attention(query=q, key=k, value=v, bias=bias)
  _close(outputs, reference.attention(q, k, v, bias=bias))
  # A [B, Sk] attention_mask is a key-padding mask.
  kpm = jnp.ones((2, 96), bool).at[:, 80:].set(False)
  _close(attention(q, k, v, attention_mask=kpm, causal=True),
         reference.attention(q, k, v, mask=kpm[:, None, None], causal=True))


def test_cached_callable_identity():
  a = flashjax.get_cached_flash_attention(backend="cpu", platform="jax",
                                          blocksize_q=64, blocksize_k=128)
  b = flashjax.get_cached_flash_attention(backend="cpu", platform="jax",
                                          blocksize_q=64, blocksize_k=128)
  c = flashjax.get_cached_flash_attention(backend="cpu", platform="jax",
                                          blocksize_q=32, blocksize_k=128)
  assert a is b and a is not c


def test_blocksize_environment_variables(monkeypatch):
  monkeypatch.setenv("BLOCKSIZE_M_FLASH_ATTN", "16")
  monkeypatch.setenv("BLOCKSIZE_N_FLASH_ATTN", "48")
  from flashjax import xla_cpu
  seen, real = {}, xla_cpu.attention_from_operands

  def spy(ops, spec, config=None):
    seen["config"] = config
    return real(ops, spec, config)

  monkeypatch.setattr(xla_cpu, "attention_from_operands", spy)
  attention = flashjax.get_cached_flash_attention(backend="cpu", platform="xla",
                                                  softmax_scale=0.25)
  q, k, v = _qkv(seed=5)
  _close(attention(q, k, v), reference.attention(q, k, v, softmax_scale=0.25))
  for blocks in (seen["config"].fwd, seen["config"].bwd):
    assert (blocks.block_q, blocks.block_kv) == (16, 48)


def test_flash_mha_style():
  q, k, v = _qkv(seed=6, hkv=4)
  out = flashjax.flash_mha(q, k, v, softmax_scale=None, is_causal=True,
                           window_size=(16, -1))
  _close(out, reference.attention(q, k, v, causal=True, sliding_window=(16, -1)))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_mha_varlen_matches_per_sequence(causal):
  lens = [5, 37, 20]
  total = sum(lens) + 6  # padding tail
  ks = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(ks[0], (total, 4, 32))
  k = jax.random.normal(ks[1], (total, 2, 32))
  v = jax.random.normal(ks[2], (total, 2, 32))
  cu = jnp.array(np.cumsum([0] + lens), jnp.int32)
  out = flashjax.flash_mha_varlen(q, k, v, cu, cu, max(lens), max(lens),
                                  is_causal=causal)
  start = 0
  for n in lens:
    sl = slice(start, start + n)
    ref = _reference(q[None, sl], k[None, sl], v[None, sl], causal=causal)[0]
    _close(out[sl], ref)
    start += n
  assert np.all(np.asarray(out[start:]) == 0)


def test_flash_mha_varlen_equal_offsets_in_two_arrays_take_the_packed_rows():
  """Causal with q and k offsets in two arrays: equal values (constant offsets,
  closed over and so concrete under jit; and traced offsets, through a lax.cond
  at run time) and different values of one total, each against the reference
  per sequence (bottom-right bands)."""
  ks = jax.random.split(jax.random.key(8), 3)
  total = 70
  q = jax.random.normal(ks[0], (total, 2, 16))
  k = jax.random.normal(ks[1], (total, 1, 16))
  v = jax.random.normal(ks[2], (total, 1, 16))
  cu = lambda lens: jnp.array(np.cumsum([0] + lens), jnp.int32)
  run = lambda q, k, v, a, b: flashjax.flash_mha_varlen(q, k, v, a, b, 40, 40,
                                                        is_causal=True)
  for lens_q, lens_k in (([10, 30, 22], [10, 30, 22]), ([10, 30, 22], [20, 20, 22])):
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    assert "cond" in str(jax.make_jaxpr(run)(q, k, v, cu_q, cu_k))
    concrete = jax.jit(lambda q, k, v: run(q, k, v, cu_q, cu_k))  # offsets constant
    for out in (concrete(q, k, v), jax.jit(run)(q, k, v, cu_q, cu_k)):
      sq = sk = 0
      for nq, nk in zip(lens_q, lens_k):
        ref = _reference(q[None, sq:sq + nq], k[None, sk:sk + nk],
                         v[None, sk:sk + nk], causal=True)[0]
        _close(out[sq:sq + nq], ref)
        sq, sk = sq + nq, sk + nk
      assert np.all(np.asarray(out[sq:]) == 0)


def test_flash_mha_varlen_cross_attention_and_errors():
  q = jax.random.normal(jax.random.key(8), (10, 2, 16))
  kv = jax.random.normal(jax.random.key(9), (14, 2, 16))
  cu_q, cu_k = jnp.array([0, 4, 10]), jnp.array([0, 9, 14])
  out = flashjax.flash_mha_varlen(q, kv, kv, cu_q, cu_k, 6, 9)
  ref0 = reference.attention(q[None, :4], kv[None, :9], kv[None, :9])[0]
  _close(out[:4], ref0)
  with pytest.raises(ValueError, match="packed"):
    flashjax.flash_mha_varlen(q[None], kv, kv, cu_q, cu_k, 6, 9)
  with pytest.raises(ValueError, match="max_seqlen_q"):
    flashjax.flash_mha_varlen(q, kv, kv, cu_q, cu_k, 0, 9)


def _varlen_inputs(lens_q, lens_k, pad_q, pad_k, heads, heads_kv, seed):
  """Packed random ``q, k, v, do`` with ``pad_q`` / ``pad_k`` padding rows past
  the sequences, and their offsets ``cu_q, cu_k``."""
  tq, tk = sum(lens_q) + pad_q, sum(lens_k) + pad_k
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (tq, heads, 16))
  k = jax.random.normal(ks[1], (tk, heads_kv, 16))
  v = jax.random.normal(ks[2], (tk, heads_kv, 16))
  do = jax.random.normal(ks[3], (tq, heads, 16))
  cu_q = jnp.array(np.cumsum([0] + lens_q), jnp.int32)
  cu_k = jnp.array(np.cumsum([0] + lens_k), jnp.int32)
  return q, k, v, do, cu_q, cu_k


def _varlen_reference(lens_q, lens_k, total_q, **kw):
  """The reference on each sequence of packed ``[total, H, D]`` rows alone,
  padding rows 0: what ``flash_mha_varlen`` must give."""
  def run(q, k, v):
    outs, a, b = [], 0, 0
    for nq, nk in zip(lens_q, lens_k):
      outs.append(reference.attention(q[None, a:a + nq], k[None, b:b + nk],
                                      v[None, b:b + nk], **kw)[0])
      a, b = a + nq, b + nk
    return jnp.concatenate(outs + [jnp.zeros((total_q - a,) + q.shape[1:])])
  return run


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (3, 0)),
                                           (True, (4, -1)), (False, (3, 2))])
def test_flash_mha_varlen_bottom_right_bands_per_sequence(causal, window):
  # Different q and k lengths per sequence (decode-like, prefill-like, q longer
  # than k), padding tails on both: each sequence's band is aligned bottom-right
  # on its own, as FlashAttention does, in output and gradients.
  lens_q, lens_k = [3, 17, 9, 1], [11, 17, 4, 6]
  q, k, v, do, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 5, 2, 4, 2, seed=17)
  tq = q.shape[0]

  def packed(q, k, v):
    return flashjax.flash_mha_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                     is_causal=causal, window_size=window)

  per_sequence = _varlen_reference(lens_q, lens_k, tq, causal=causal,
                                   sliding_window=window)

  out, vjp = jax.vjp(jax.jit(packed), q, k, v)
  ref, ref_vjp = jax.vjp(jax.jit(per_sequence), q, k, v)
  _close(out, ref)
  assert np.all(np.asarray(out[sum(lens_q):]) == 0)
  for g, r in zip(vjp(do), ref_vjp(do)):
    _close(g, r)


@pytest.mark.parametrize("lens_q,lens_k,causal,window,end_aligned", [
    # No sequence with more queries than keys (a prefill after a cached
    # prefix): the key rows, whatever the band; under jit a window past the
    # diagonal keeps the other layout for offsets that may not fit (a lax.cond).
    ([3, 17, 4, 1], [11, 17, 9, 6], True, (5, -1), "never"),
    ([3, 17, 4, 1], [11, 17, 9, 6], False, (5, 2), "jit"),
    # More queries than keys in the second and third sequence: a band that ends
    # on the diagonal still takes the key rows (their first queries see no key).
    ([3, 17, 9, 1], [11, 6, 4, 6], True, (-1, -1), "never"),
    ([3, 17, 9, 1], [11, 6, 4, 6], False, (4, 0), "never"),
    ([3, 17, 9, 1], [11, 6, 4, 6], False, (5, 2), "always"),
])
def test_flash_mha_varlen_queries_on_their_keys_rows(lens_q, lens_k, causal, window,
                                                      end_aligned):
  """Different offsets: the q rows move onto their keys' rows, K and V stay
  where they are and no layout of total_q + total_k rows is built, where no
  sequence has more queries than keys or the band ends on the diagonal; with
  concrete offsets and under jit. Outputs and gradients against the reference
  per sequence (bottom-right bands; queries that see no key output 0)."""
  q, k, v, do, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 3, 2, 2, 1, seed=23)
  tq, tk = q.shape[0], k.shape[0]
  run = lambda q, k, v, a, b: flashjax.flash_mha_varlen(
      q, k, v, a, b, max(lens_q), max(lens_k), is_causal=causal, window_size=window)

  per_sequence = _varlen_reference(lens_q, lens_k, tq, causal=causal,
                                   sliding_window=window)

  rows = f"[{tq + tk},"  # the end-aligned layout's row count
  concrete = str(jax.make_jaxpr(lambda q, k, v: run(q, k, v, cu_q, cu_k))(q, k, v))
  traced = str(jax.make_jaxpr(run)(q, k, v, cu_q, cu_k))
  assert (rows in concrete) == (end_aligned == "always"), concrete
  assert (rows in traced) == (end_aligned != "never"), traced
  ref, ref_vjp = jax.vjp(jax.jit(per_sequence), q, k, v)
  # Closed-over offsets stay concrete under jit: the layout of `concrete` above.
  out, vjp = jax.vjp(jax.jit(lambda q, k, v: run(q, k, v, cu_q, cu_k)), q, k, v)
  for got in (out, jax.jit(run)(q, k, v, cu_q, cu_k)):
    _close(got, ref)
    assert np.all(np.asarray(got[sum(lens_q):]) == 0)
  for g, r in zip(vjp(do), ref_vjp(do)):
    _close(g, r)
  assert float(jnp.std(ref)) > 0.1, "a case that cannot fail"


# -- platform choice ------------------------------------------------------------------


def test_automatic_choice_on_cpu_is_xla():
  assert registry.preferred_order("cpu") == ["xla"]
  assert registry.preferred_order("tpu") == ["pallas-tpu", "xla"]
  assert registry.preferred_order("gpu")[-1] == "xla"


def test_a_copy_under_another_name_dispatches_to_its_own_platforms(tmp_path, monkeypatch):
  # Two trees side by side in one process (an A/B of a change): each one's
  # registry must load its own kernels, not the installed flashjax's.
  (tmp_path / "flashjax_copy").symlink_to(flashjax.__path__[0], target_is_directory=True)
  monkeypatch.syspath_prepend(str(tmp_path))
  copy = __import__("flashjax_copy.registry").registry
  assert copy.load("xla").__name__ == "flashjax_copy.xla_cpu"
  assert registry.load("xla").__name__ == "flashjax.xla_cpu"


@CPU_ONLY
def test_fall_through_logs_once_and_runs_next(monkeypatch, caplog):
  monkeypatch.setattr(registry, "preferred_order",
                      lambda backend: ["triton", "pallas-triton", "xla"])
  monkeypatch.setattr(registry, "PLATFORMS", {
      **registry.PLATFORMS,
      "triton": registry.Platform("triton", "triton_gpu", ("cpu",)),
      "pallas-triton": registry.Platform("pallas-triton", "pallas_gpu.triton.pallas_triton",
                                         ("cpu",))})
  registry._logged.clear()
  q, k, v = _qkv(seed=10)
  with caplog.at_level(logging.WARNING, logger="flashjax"):
    out = flashjax.flash_attention(q, k, v)
    flashjax.flash_attention(q, k, v)
  _close(out, reference.attention(q, k, v))
  msgs = [r.message for r in caplog.records if "running xla" in r.message]
  # triton cannot run on CPU: not installed, no GPU jaxlib, or no GPU; the log says.
  assert len(msgs) == 1 and "triton:" in msgs[0] and any(
      why in msgs[0] for why in ("not installed", "does not import", "needs a GPU"))


@CPU_ONLY
def test_explicit_platform_that_cannot_run_raises_with_reason():
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match="'triton'.*not for backend 'cpu'"):
    flashjax.flash_attention(q, k, v, platform="triton")
  with pytest.raises(NotImplementedError, match="pallas-mosaic-gpu"):
    flashjax.flash_attention(q, k, v, platform="pallas", backend="gpu")
  with pytest.raises(ValueError, match="platform must be one of"):
    flashjax.flash_attention(q, k, v, platform="cuda")
  with pytest.raises(ValueError, match="backend must be one of"):
    flashjax.flash_attention(q, k, v, backend="metal")
  with pytest.raises(ValueError, match="interpret=True"):
    flashjax.flash_attention(q, k, v, platform="xla", interpret=True)
  # Mosaic-GPU is a Pallas platform without an interpret mode (its capabilities say).
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  with pytest.raises(ValueError, match="'pallas-mosaic-gpu' has none"):
    flashjax.flash_attention(qb, kb, vb, platform="pallas", backend="gpu",
                             interpret=True)


@CPU_ONLY
def test_no_platform_left_reports_every_reason(monkeypatch):
  monkeypatch.setattr(registry, "preferred_order", lambda b: ["triton", "pallas-tpu"])
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError) as e:
    flashjax.flash_attention(q, k, v)
  assert "triton" in str(e.value) and "pallas-tpu" in str(e.value)


@CPU_ONLY
def test_platform_environment_variable(monkeypatch):
  monkeypatch.setenv("FLASHJAX_PLATFORM", "triton")
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match="triton"):
    flashjax.flash_attention(q, k, v)


def test_every_platform_follows_the_protocol():
  """common/platform.py: each registered platform declares its name, capabilities
  and config type, and its reasons name no platform (the registry adds it)."""
  wide = spec_lib.abstract_spec(batch=1, seq_q=8, seq_k=8, heads_q=2, head_dim=320,
                                dtype="float32")
  for name in registry.PLATFORMS:
    mod = registry.load(name)
    assert mod.NAME == name
    assert isinstance(mod.CAPABILITIES, platform.Capabilities), name
    assert dataclasses.is_dataclass(mod.CONFIG), name
    assert mod.CONFIG.__dataclass_params__.frozen, name
    for fn in ("supported", "default_config", "attention_from_operands",
               "flash_attention"):
      assert callable(getattr(mod, fn)), (name, fn)
    reason = mod.supported(wide)
    assert (reason is None) == (name == "xla"), (name, reason)
    assert reason is None or not reason.startswith(name), reason
    backend = registry.PLATFORMS[name].backends[0]
    if reason is not None:
      assert registry.reason_unsupported(name, wide, backend) == f"{name}: {reason}"


@CPU_ONLY
def test_config_pins_the_automatic_choice_to_its_platform():
  """A config runs on its own platform or raises; it never reaches another."""
  from flashjax import pallas_tpu, xla_cpu
  q, k, v = _qkv(b=1, sq=40, sk=40, hq=2, hkv=1, d=16, seed=14)
  out = flashjax.flash_attention(q, k, v, causal=True,
                                 config=xla_cpu.XlaConfig(
                                     fwd=xla_cpu.BlockSizes(block_q=16, block_kv=16)))
  _close(out, reference.attention(q, k, v, causal=True))
  with pytest.raises(ValueError, match=r"config is a TpuConfig.*\('xla' on backend "
                     r"'cpu', which takes a XlaConfig\)"):
    flashjax.flash_attention(q, k, v, config=pallas_tpu.TpuConfig())
  with pytest.raises(ValueError, match="config must be a XlaConfig"):
    flashjax.flash_attention(q, k, v, platform="xla", config=pallas_tpu.TpuConfig())


def test_platform_aliases():
  assert registry.resolve("jax", "cpu") == "xla"
  assert registry.resolve("pallas", "tpu") == "pallas-tpu"
  assert registry.resolve("pallas", "gpu") == "pallas-mosaic-gpu"
  assert registry.resolve("pallas-triton", "gpu") == "pallas-triton"


# -- transformations --------------------------------------------------------------------


def test_checkpoint_policy_saves_named_residuals():
  q, k, v = _qkv(seed=12)
  policy = jax.checkpoint_policies.save_only_these_names("flashjax_out", "flashjax_lse")

  def loss(q, k, v):
    return jnp.sum(flashjax.flash_attention(q, k, v, causal=True) ** 2)

  g1 = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2)))(q, k, v)
  g2 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  jaxpr = str(jax.make_jaxpr(jax.grad(jax.checkpoint(loss, policy=policy)))(q, k, v))
  assert "flashjax_out" in jaxpr and "flashjax_lse" in jaxpr


def test_vmap_over_an_extra_axis():
  q, k, v = _qkv(seed=13)
  stack = lambda x: jnp.stack([x, x * 0.5])
  out = jax.vmap(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True))(
      stack(q), stack(k), stack(v))
  _close(out[1], reference.attention(q * 0.5, k * 0.5, v * 0.5, causal=True))


@CPU_ONLY
def test_backend_detection_from_inputs():
  q, k, v = _qkv()
  assert api.detect_backend(None, q) == "cpu"
  assert api.detect_backend("tpu", q) == "tpu"
