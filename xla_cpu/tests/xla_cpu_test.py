"""The conformance suite on xla_cpu, plus what is specific to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import xla_cpu
from flashjax.common import conformance, conformance_kvcache, reference, tolerances


class TestXlaCpu(conformance.ConformanceSuite):
  CAPS = conformance.Capabilities(name="xla_cpu")

  def attention(self, q, k, v, **kwargs):
    return xla_cpu.flash_attention(q, k, v, **kwargs)


class TestXlaCpuSmallBlocks(conformance.ConformanceSuite):
  """Many blocks per sequence: exercises skipping and partial tail blocks."""

  CAPS = conformance.Capabilities(name="xla_cpu[16x32]", max_seq_len=1000,
                                  hypothesis_examples=8)

  def attention(self, q, k, v, **kwargs):
    return xla_cpu.flash_attention(
        q, k, v, config=xla_cpu.XlaConfig(block_q=16, block_kv=32), **kwargs)


class TestXlaKvCache(conformance_kvcache.KvCacheSuite):
  """The KV-cache entry on the blockwise xla path, with blocks of 16 positions so
  that most cases walk several blocks (and pages)."""

  KV_CAPS = conformance_kvcache.KvCapabilities(name="xla[kvcache]")

  def kvcache(self, *args, **kwargs):
    return flashjax.flash_mha_with_kvcache(
        *args, backend="cpu", platform="xla",
        config=xla_cpu.XlaConfig(block_kv=16), **kwargs)
