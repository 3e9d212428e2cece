"""The conformance suite on xla_cpu, plus what is specific to it."""

import jax
import jax.numpy as jnp

import flashjax
from flashjax import xla_cpu
from flashjax.common import conformance, conformance_kvcache, conformance_packed

# Forward and backward blocks differ, so the backward cannot lean on the
# forward's blocking (the lse is per row, whatever the blocks).
SMALL = xla_cpu.XlaConfig(fwd=xla_cpu.BlockSizes(block_q=16, block_kv=32),
                          bwd=xla_cpu.BlockSizes(block_q=32, block_kv=16))


class TestXlaCpu(conformance.ConformanceSuite):
  """The default blocks (512 x 256) on the tests whose results depend on the
  blocks and that reach past one block: shapes (up to 1000 tokens), dtypes (333
  keys) and the combinations' single-block walks. Random cases and head dims of
  up to 300 tokens fit one or two default blocks. The small-block instance below
  runs the whole suite."""

  CAPS = conformance.Capabilities.of(xla_cpu.CAPABILITIES, name="xla_cpu")
  SUBSET = frozenset({"test_shapes", "test_dtypes", "test_combinations"})

  def attention(self, q, k, v, **kwargs):
    return xla_cpu.flash_attention(q, k, v, **kwargs)


class TestXlaCpuSmallBlocks(conformance.ConformanceSuite):
  """Many blocks per sequence: exercises skipping and partial tail blocks (16 x 32
  forward, 32 x 16 backward)."""

  CAPS = conformance.Capabilities.of(xla_cpu.CAPABILITIES, name="xla_cpu[16x32]",
                                     max_seq_len=1000, hypothesis_examples=8)

  def attention(self, q, k, v, **kwargs):
    return xla_cpu.flash_attention(
        q, k, v, config=SMALL, **kwargs)


def test_blocks_between_documents_are_skipped():
  """Forward and backward loops leave out the blocks of other documents: one
  document's NaN values reach no other document."""
  conformance_packed.check_skips_between_documents(
      lambda *a, **kw: xla_cpu.flash_attention(*a, config=SMALL, **kw),
      doc_len=32, causal=True)


class TestXlaKvCache(conformance_kvcache.KvCacheSuite):
  """The KV-cache entry on the blockwise xla path, with blocks of 16 positions so
  that most cases walk several blocks (and pages)."""

  KV_CAPS = conformance_kvcache.KvCapabilities(name="xla[kvcache]")

  def kvcache(self, *args, **kwargs):
    blocks = xla_cpu.BlockSizes(block_q=16, block_kv=16)
    return flashjax.flash_mha_with_kvcache(
        *args, backend="cpu", platform="xla",
        config=xla_cpu.XlaConfig(fwd=blocks, bwd=blocks), **kwargs)


def _paged_decode(pages_per_row):
  b, h, d = 2, 2, 64
  sd = jax.ShapeDtypeStruct
  cache = sd((b * pages_per_row, 16, h, d), jnp.float32)
  fn = jax.jit(lambda q, kc, vc, table, lens: flashjax.flash_mha_with_kvcache(
      q, kc, vc, cache_seqlens=lens, page_table=table, backend="cpu"))
  return fn.lower(sd((b, 1, h, d), jnp.float32), cache, cache,
                  sd((b, pages_per_row), jnp.int32), sd((b,), jnp.int32)).compile()


def test_kvcache_memory_does_not_grow_with_the_cache():
  """Beyond the cache itself the xla path holds one block: 8x the cache, the
  same temporaries (531 kB at 2 MB and at 16 MB of cache, CPU, 2026-11-24)."""
  small, large = (_paged_decode(n).memory_analysis() for n in (64, 512))
  cache_bytes = 2 * 2 * 512 * 16 * 2 * 64 * 4
  assert large.temp_size_in_bytes <= 1.1 * small.temp_size_in_bytes
  assert large.temp_size_in_bytes < cache_bytes / 16


def test_kvcache_update_is_in_place_when_donated():
  import functools
  arrays, static = conformance_kvcache.make_kv_inputs(conformance_kvcache.KvCase(
      seq_new=1, page_size=4, capacity=16, seed=2))
  # Buffers XLA owns (arrays made from numpy may alias numpy's memory).
  k_cache, v_cache = arrays.pop("k_cache") + 0, arrays.pop("v_cache") + 0
  where = k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()
  step = jax.jit(functools.partial(flashjax.flash_mha_with_kvcache, **static,
                                   return_updated_cache=True),
                 donate_argnums=(1, 2))
  _, k_new, v_new = step(arrays.pop("q"), k_cache, v_cache, **arrays)
  assert k_cache.is_deleted() and v_cache.is_deleted()
  assert (k_new.unsafe_buffer_pointer(), v_new.unsafe_buffer_pointer()) == where
