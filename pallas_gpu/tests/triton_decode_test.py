"""The Pallas-Triton split-KV decode forward (interpret mode on CPU) against the
reference: packed GQA rows, ragged key tails, bands, soft cap, sinks, lse, and the
split count changing nothing but rounding; gradients run the training backward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import reference, spec as spec_lib
from flashjax.pallas_gpu.triton import decode as triton_decode, pallas_triton

CASES = [
    dict(sq=1, sk=300, hq=8, hkv=2),
    dict(sq=3, sk=257, hq=4, hkv=4, causal=True, splits=3),
    dict(sq=4, sk=200, hq=8, hkv=1, sliding_window=(50, 0), causal=True,
         logits_soft_cap=5.0),
    dict(sq=2, sk=128, hq=4, hkv=2, sinks=True, dtype=jnp.float16, splits=1),
    # Powers of two filling 16 or more rows: q read and results written in the
    # call's layout (decode.direct), one split writing the results itself.
    dict(sq=4, sk=300, hq=16, hkv=4, causal=True, dtype=jnp.float16, splits=1),
    dict(sq=8, sk=270, hq=8, hkv=2, sliding_window=(200, 0), causal=True, splits=3),
    dict(sq=16, sk=200, hq=8, hkv=2, causal=True, sinks=True, splits=1),
]


def _inputs(c, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  dtype = c.get("dtype", jnp.float32)
  q = jax.random.normal(ks[0], (2, c["sq"], c["hq"], 64), dtype)
  k = jax.random.normal(ks[1], (2, c["sk"], c["hkv"], 64), dtype)
  v = jax.random.normal(ks[2], (2, c["sk"], c["hkv"], 32), dtype)
  kw = {n: c[n] for n in ("causal", "sliding_window", "logits_soft_cap") if n in c}
  if c.get("sinks"):
    kw["sinks"] = jax.random.normal(ks[3], (c["hq"],))
  return q, k, v, kw


@pytest.mark.parametrize("c", CASES, ids=str)
def test_decode_forward_matches_reference(c):
  q, k, v, kw = _inputs(c)
  ops, spec = spec_lib.canonicalize(q, k, v, return_lse=True, **kw)
  assert triton_decode.applies(spec)
  cfg = triton_decode.DecodeConfig(block_kv=64, num_splits=c.get("splits", 2))
  if "splits" in c:  # the split count the case names is the one that runs
    assert triton_decode.num_splits(spec, cfg, 132) == c["splits"]
  out, lse = jax.jit(lambda ops: triton_decode.forward(ops, spec, cfg, 132, True))(ops)
  want, want_lse = jax.jit(lambda q, k, v: reference.attention(
      q, k, v, return_lse=True, **kw))(q, k, v)
  tol = 2e-2 if q.dtype == jnp.float16 else 2e-5
  np.testing.assert_allclose(out.astype(jnp.float32), want, atol=tol, rtol=tol)
  np.testing.assert_allclose(lse, want_lse, atol=tol, rtol=tol)


def test_direct_layout_only_for_powers_of_two_filling_the_tile():
  mk = lambda **kw: spec_lib.abstract_spec(**{**dict(
      batch=1, seq_q=16, seq_k=4096, heads_q=32, heads_kv=8, head_dim=128), **kw})
  assert triton_decode.direct(mk())  # 16 queries x 4 heads
  assert triton_decode.direct(mk(seq_q=4, heads_q=32, heads_kv=8))  # 16 rows
  assert not triton_decode.direct(mk(seq_q=1))  # 4 rows: padded to 16
  assert not triton_decode.direct(mk(seq_q=3, heads_q=64))  # 3 queries
  assert not triton_decode.direct(mk(seq_q=8, heads_q=48))  # 6 heads per kv head
  assert not triton_decode.direct(mk(seq_q=32))  # 128 rows
  s = mk()
  assert triton_decode.final(s, 1) and not triton_decode.final(s, 2)
  assert not triton_decode.final(mk(seq_q=1), 1)


def test_one_direct_split_writes_the_results_in_the_input_dtype():
  """No fp32 partials and no merge: the kernel's output is the call's."""
  c = dict(sq=4, sk=300, hq=16, hkv=4, causal=True, dtype=jnp.float16)
  q, k, v, kw = _inputs(c)
  ops, spec = spec_lib.canonicalize(q, k, v, **kw)
  cfg = triton_decode.DecodeConfig(block_kv=64, num_splits=1)
  o, lse = triton_decode.partials(ops.q, ops.k, ops.v, spec, cfg, 1, True)
  assert o.dtype == jnp.float16 and o.shape == (1, 2, 4, 16, 32)
  assert lse.shape == (1, 2, 16, 4)
  out, out_lse = triton_decode.combine(o, lse, spec)
  assert out.dtype == jnp.float16 and out.shape == (2, 4, 16, 32)
  want, want_lse = reference.attention(q, k, v, return_lse=True, **kw)
  np.testing.assert_allclose(out.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(out_lse, want_lse, atol=2e-2, rtol=2e-2)


def test_decode_split_counts_agree_and_grad_runs():
  c = dict(sq=1, sk=300, hq=8, hkv=2)
  q, k, v, _ = _inputs(c, seed=1)
  ops, spec = spec_lib.canonicalize(q, k, v)
  outs = [triton_decode.forward(ops, spec, triton_decode.DecodeConfig(
      block_kv=64, num_splits=n), 132, True)[0] for n in (1, 5)]
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)
  do = jax.random.normal(jax.random.key(5), outs[0].shape)
  f = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * do)
  got = jax.jit(jax.grad(f(lambda *a: pallas_triton.flash_attention(*a, interpret=True)),
                         argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(f(reference.attention), argnums=(0, 1, 2)))(q, k, v)
  for a, w in zip(got, want):
    np.testing.assert_allclose(a, w, atol=5e-5, rtol=5e-5)


def test_decode_applies_only_to_decode_shapes():
  mk = lambda **kw: spec_lib.abstract_spec(**{**dict(
      batch=1, seq_q=1, seq_k=4096, heads_q=32, heads_kv=8, head_dim=128), **kw})
  assert triton_decode.applies(mk())
  assert triton_decode.applies(mk(seq_q=16))
  assert not triton_decode.applies(mk(seq_q=32))  # 128 packed rows
  assert not triton_decode.applies(mk(head_dim=80))
  assert not triton_decode.applies(mk(seq_q=128, seq_k=128, heads_q=8))
  # About two programs per SM: B64 Hkv8 (512 programs) runs unsplit.
  cfg = triton_decode.DecodeConfig()
  assert triton_decode.num_splits(mk(batch=64, seq_k=8192), cfg, 132) == 1
  assert triton_decode.num_splits(mk(batch=8, seq_k=65536), cfg, 132) == 4
  assert triton_decode.num_splits(mk(batch=1, seq_k=131072), cfg, 132) == 33
  assert triton_decode.default_config(mk(seq_q=16)).block_kv == 32  # 64 rows
  assert triton_decode.default_config(mk(seq_q=8)).block_kv == 64  # 32 rows
  with pytest.raises(ValueError, match="block_kv"):
    triton_decode.DecodeConfig(block_kv=48)


@pytest.mark.parametrize("sq,hq,hkv,splits", [
    (1, 32, 8, 0),   # 4 rows per kv head: packed by XLA, padded to 16
    (16, 32, 8, 1),  # 64 rows, the call's layout, one split: no XLA around it
    (1, 16, 1, 1),   # MQA step, 16 rows
    (4, 32, 8, 3),   # 16 rows, three splits merged in XLA
])
def test_decode_lowers_for_cuda(sq, hq, hkv, splits):
  sd = jax.ShapeDtypeStruct

  def fwd(q, k, v):
    ops, s = spec_lib.canonicalize(q, k, v)
    return triton_decode.forward(
        ops, s, triton_decode.DecodeConfig(num_splits=splits), 132, False)

  text = jax.jit(fwd).trace(sd((4, sq, hq, 128), jnp.bfloat16),
                            sd((4, 8192, hkv, 128), jnp.bfloat16),
                            sd((4, 8192, hkv, 128), jnp.bfloat16)).lower(
                                lowering_platforms=("cuda",)).as_text()
  assert "flashjax_pallas_triton_decode" in text
  direct = triton_decode.direct(spec_lib.abstract_spec(
      batch=4, seq_q=sq, seq_k=8192, heads_q=hq, heads_kv=hkv, head_dim=128))
  assert direct == (sq * hq // hkv >= 16)
  # Packing q moves its rows (a transpose, or a pad where Sq = 1); the direct
  # layout reads q as it is and, with one split, returns the kernel's output.
  # (Merging splits transposes their small [B, Hq, Sq] weights.)
  moved = "stablehlo.transpose" in text or "stablehlo.pad" in text
  if not direct:
    assert moved
  elif splits == 1:
    assert not moved
    assert "stablehlo.reduce" not in text and "stablehlo.exponential" not in text


@pytest.mark.parametrize("page_size", [None, 64])
def test_kvcache_kernel_lowers_for_cuda(page_size):
  import flashjax
  sd = jax.ShapeDtypeStruct
  b, cap = 4, 4096
  if page_size:
    cache = sd((b * cap // page_size, page_size, 8, 128), jnp.bfloat16)
    extra = dict(page_table=sd((b, cap // page_size), jnp.int32))
  else:
    cache = sd((b + 2, cap, 8, 128), jnp.bfloat16)
    extra = dict(cache_batch_idx=sd((b,), jnp.int32))

  def f(q, kc, vc, lens, extra):
    return flashjax.flash_mha_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                           backend="gpu", platform="pallas",
                                           num_splits=0, **extra)

  text = jax.jit(f).trace(sd((b, 1, 32, 128), jnp.bfloat16), cache, cache,
                          sd((b,), jnp.int32), extra).lower(
                              lowering_platforms=("cuda",)).as_text()
  assert "flashjax_pallas_triton_kvcache" in text


def test_default_tiles_fit_shared_memory():
  """Wide heads and fp32 get fewer stages or shorter tiles; bf16 at D = 128 keeps
  the tiles measured on an H200."""
  mk = lambda **kw: spec_lib.abstract_spec(**{**dict(
      batch=8, seq_q=1, seq_k=65536, heads_q=32, heads_kv=8, head_dim=128), **kw})
  budget = 232448 - 4096
  bf16 = mk()
  rows = triton_decode.packed_rows(bf16)
  assert triton_decode.fit(triton_decode.default_config(bf16), bf16, rows,
                           budget) == triton_decode.default_config(bf16)
  for s in (mk(head_dim=256), mk(dtype="float32"), mk(dtype="float32", head_dim=256),
            mk(seq_q=16, head_dim=256)):
    rows = triton_decode.packed_rows(s)
    cfg = triton_decode.fit(triton_decode.default_config(s), s, rows, budget)
    assert triton_decode.shared_bytes(cfg, s, rows) <= budget, (s, cfg)
    assert cfg.block_kv >= 16 and cfg.num_stages >= 2
  # The overflow Triton reported (278528 bytes) is what the estimate gives.
  s = mk(seq_q=16)
  assert triton_decode.shared_bytes(triton_decode.DecodeConfig(
      block_kv=128, num_stages=4), s, triton_decode.packed_rows(s)) == 278528


def test_kvcache_default_tiles_are_the_tiles_that_run():
  """Pages that 64 does not divide load gathered 64-key tiles in 6 stages (the
  pipeline they were measured with on an H200; fitting keeps it); pages of 64
  and more load each tile from one page; contiguous caches take decode.py's
  tiles; the default names the tile that runs."""
  from flashjax.common import kvcache as kv
  from flashjax.pallas_gpu.triton import kvcache as tk
  budget = 232448 - 4096
  mk = lambda **kw: kv.KvCacheSpec(**{**dict(
      batch=64, seq_q=1, heads_q=32, heads_kv=8, head_dim=128, head_dim_v=128,
      dtype="bfloat16", softmax_scale=0.1, cache_rows=64 * 512, capacity=8192,
      page_size=16, num_splits=0), **kw})
  for spec, want, gathered in (
      (mk(), (64, 6, 4), True), (mk(page_size=32), (64, 6, 4), True),
      (mk(page_size=1), (64, 6, 4), True), (mk(page_size=8), (64, 6, 4), True),
      (mk(seq_q=16), (64, 6, 4), True), (mk(page_size=64), (64, 6, 2), False),
      (mk(page_size=64, seq_q=16), (64, 6, 4), False),
      (mk(page_size=256, seq_q=16), (64, 6, 4), False),
      (mk(page_size=256), (128, 3, 4), False),
      (mk(page_size=None, cache_rows=64), (128, 3, 4), False),
      (mk(page_size=None, cache_rows=64, seq_q=16), (32, 4, 4), False)):
    cfg = triton_decode.fit(tk.default_config(spec), spec,
                            triton_decode.packed_rows(spec), budget)
    assert (cfg.block_kv, cfg.num_stages, cfg.num_warps) == want, (spec, cfg)
    assert tk._block_kv(spec, cfg) == cfg.block_kv
    assert tk.gathered(spec, cfg.block_kv) == gathered, spec
  # A tile no longer than the row needs (rounded up to a power of two, >= 16).
  short = mk(page_size=5, capacity=35)
  assert tk._block_kv(short, tk.default_config(short)) == 64
  tiny = mk(page_size=1, capacity=12)
  assert tk._block_kv(tiny, tk.default_config(tiny)) == 16
  assert tk.supported(mk(page_size=7, capacity=35)) is None


@pytest.mark.parametrize("page_size,block_kv,sq",
                         [(16, 64, 2), (16, 32, 4), (5, 16, 2), (96, 64, 4)])
def test_kvcache_gathered_tiles_match_page_tiles(page_size, block_kv, sq):
  """A tile gathered across pages (interpret mode) gives what the xla path gives,
  on a pool whose unused pages hold NaN and rows that end mid-tile, mid-page and
  past the last whole tile; two splits, with q packed (Sq = 2: 8 rows) or read
  in the call's layout (Sq = 4: 16 rows)."""
  import flashjax
  from flashjax.pallas_gpu.triton import kvcache as tk
  rng = np.random.default_rng(page_size + block_kv)
  b, hq, hkv, d, max_pages = 3, 8, 2, 64, 9
  cap = max_pages * page_size
  num_pages = b * max_pages + 2
  kc = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
  vc = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
  table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages)
  lens = np.array([cap, cap // 2 + 3, 1 + page_size])
  for row in range(b):  # pages past a row's length hold NaN
    used = -(-int(lens[row]) // page_size)
    kc[table[row, used:]] = np.nan
    vc[table[row, used:]] = np.nan
  q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
  args = (jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc))
  kw = dict(cache_seqlens=jnp.asarray(lens, jnp.int32), is_causal=True,
            page_table=jnp.asarray(table, jnp.int32), return_softmax_lse=True)
  cfg = triton_decode.DecodeConfig(block_kv=block_kv, num_stages=2, num_splits=2)
  spec = flashjax.common.kvcache.KvCacheSpec(
      batch=b, seq_q=sq, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=d,
      dtype="float32", softmax_scale=0.1, cache_rows=num_pages, capacity=cap,
      page_size=page_size)
  assert tk.gathered(spec, tk._block_kv(spec, cfg))
  assert triton_decode.direct(spec) == (sq == 4)
  assert tk.num_splits(spec, cfg, 132) == 2
  got = flashjax.flash_mha_with_kvcache(*args, **kw, backend="gpu",
                                        platform="pallas-triton", interpret=True,
                                        config=cfg)
  want = flashjax.flash_mha_with_kvcache(*args, **kw, platform="xla")
  for x, y in zip(got, want):
    assert not np.isnan(np.asarray(x)).any()
    np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5)


def test_kvcache_direct_layout_with_splits_and_sinks_matches_xla():
  """A contiguous cache, 16 query rows per kv head (the call's layout), three
  splits merged through their lse, sinks added after the merge."""
  import flashjax
  from flashjax.pallas_gpu.triton import kvcache as tk
  rng = np.random.default_rng(11)
  b, sq, hq, hkv, d, cap = 2, 4, 8, 2, 32, 200
  q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), jnp.float32)
  kc = jnp.asarray(rng.standard_normal((b, cap, hkv, d)), jnp.float32)
  vc = jnp.asarray(rng.standard_normal((b, cap, hkv, d)), jnp.float32)
  kw = dict(cache_seqlens=jnp.asarray([cap, 150], jnp.int32), is_causal=True,
            sinks=jnp.asarray(rng.standard_normal(hq), jnp.float32),
            return_softmax_lse=True)
  cfg = triton_decode.DecodeConfig(block_kv=32, num_stages=2, num_splits=3)
  spec = flashjax.common.kvcache.KvCacheSpec(
      batch=b, seq_q=sq, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=d,
      dtype="float32", softmax_scale=0.1, cache_rows=b, capacity=cap,
      page_size=None, num_splits=3, num_sinks=1)
  assert triton_decode.direct(spec) and tk.num_splits(spec, cfg, 132) == 3
  got = flashjax.flash_mha_with_kvcache(q, kc, vc, **kw, backend="gpu",
                                        platform="pallas-triton", interpret=True,
                                        config=cfg)
  want = flashjax.flash_mha_with_kvcache(q, kc, vc, **kw, platform="xla")
  for x, y in zip(got, want):
    np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5)
