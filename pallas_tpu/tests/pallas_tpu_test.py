"""The conformance suite on the Pallas TPU kernels in TPU interpret mode (CPU), plus
block skipping counted inside the kernel."""

import jax
import pytest

import flashjax
from flashjax import pallas_tpu
from flashjax.common import conformance, conformance_kvcache


class TestPallasTpuInterpret(conformance.ConformanceSuite):
  # Interpret mode simulates every DMA: keep sequences short.
  CAPS = conformance.Capabilities.of(
      pallas_tpu.CAPABILITIES, name="pallas-tpu[interpret]", max_seq_len=400,
      hypothesis_examples=4)

  def attention(self, q, k, v, **kwargs):
    return pallas_tpu.flash_attention(q, k, v, interpret=True, **kwargs)


def _qkv(s=1024, d=64):
  ks = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(key, (1, s, 1, d)) for key in ks]


def test_causal_runs_about_half_the_kv_steps():
  # Five blocks a side: every step interpreted costs time, and five already
  # tell a triangle and a band of two diagonals from the full square.
  q, k, v = _qkv(640)
  cfg = pallas_tpu.TpuConfig(fwd=pallas_tpu.BlockSizes(block_q=128, block_kv=128))
  full = pallas_tpu.count_kv_steps(q, k, v, config=cfg)
  causal = pallas_tpu.count_kv_steps(q, k, v, config=cfg, causal=True)
  assert full == 25  # 5 q blocks x 5 kv blocks
  assert causal == 15  # 1 + 2 + ... + 5: the diagonal blocks and below
  window = pallas_tpu.count_kv_steps(q, k, v, config=cfg, sliding_window=(128, 0))
  assert window == 9  # the diagonal block and the one before it


def test_segments_skip_blocks():
  import jax.numpy as jnp
  q, k, v = _qkv(512)
  cfg = pallas_tpu.TpuConfig(fwd=pallas_tpu.BlockSizes(block_q=128, block_kv=128))
  ids = (jnp.arange(512) // 128)[None]
  assert pallas_tpu.count_kv_steps(q, k, v, config=cfg, segment_ids=(ids, ids)) == 4


def test_needs_tpu_or_interpret():
  q, k, v = _qkv(128)
  if jax.default_backend() != "tpu":
    with pytest.raises(NotImplementedError, match="interpret=True"):
      pallas_tpu.flash_attention(q, k, v)


def test_frontend_runs_it_in_interpret_mode():
  import flashjax
  from flashjax.common import reference, tolerances
  q, k, v = _qkv(256)
  out = flashjax.flash_attention(q, k, v, causal=True, backend="tpu",
                                 platform="pallas", interpret=True)
  tolerances.assert_close(out, reference.attention(q, k, v, causal=True),
                          tolerances.forward("float32"))


def test_config_validation():
  with pytest.raises(ValueError, match="block_kv must be a positive multiple of 128"):
    pallas_tpu.BlockSizes(block_q=128, block_kv=64)
  with pytest.raises(ValueError, match="block_q"):
    pallas_tpu.BlockSizes(block_q=100, block_kv=128)


class TestPallasTpuKvCacheInterpret(conformance_kvcache.KvCacheSuite):
  """The paged decode kernel in TPU interpret mode; contiguous caches step by 16
  positions, so most cases walk several blocks and a partial last one."""

  KV_CAPS = conformance_kvcache.KvCapabilities(
      name="pallas-tpu[kvcache,interpret]", head_dim_ok=lambda d: d <= 256,
      hypothesis_examples=2)

  def kvcache(self, *args, **kwargs):
    return flashjax.flash_mha_with_kvcache(
        *args, backend="tpu", platform="pallas", interpret=True,
        config=pallas_tpu.KvCacheConfig(block_kv=16), **kwargs)


def test_kvcache_kernel_runs_only_the_pages_a_row_can_see():
  import jax.numpy as jnp
  import numpy as np
  from flashjax.common import kvcache
  b, h, d, ps = 3, 1, 32, 4
  q = jnp.ones((b, 2, h, d))
  pool = jnp.ones((24, ps, h, d))
  table = jnp.arange(24, dtype=jnp.int32).reshape(b, 8)
  def steps(**kw):
    ops, spec = kvcache.canonicalize(
        q, pool, pool, cache_seqlens=jnp.array([5, 30, 0], jnp.int32),
        page_table=table, **kw)
    res = pallas_tpu.kvcache_attention(kvcache.prepare(ops, spec), None, spec,
                                       interpret=True, count=True)
    return np.asarray(res[2])[:, 0].tolist()
  # Keys [0, 5): pages 0-1; [0, 30): pages 0-7; nothing: no step.
  assert steps() == [2, 8, 0]
  # Leftpad 4 leaves position 4 (page 1); a window of 3 left of the first
  # query leaves positions [25, 30) (pages 6-7) whatever the leftpad of 9.
  assert steps(cache_leftpad=jnp.array([4, 9, 0], jnp.int32),
               window_size=(3, 0)) == [1, 2, 0]
