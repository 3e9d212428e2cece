"""The conformance suite on xla_cpu, plus what is specific to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import xla_cpu
from flashjax.common import (conformance, conformance_kvcache, conformance_packed,
                             reference, tolerances)


class TestXlaCpu(conformance.ConformanceSuite):
  CAPS = conformance.Capabilities.of(xla_cpu.CAPABILITIES, name="xla_cpu")

  def attention(self, q, k, v, **kwargs):
    return xla_cpu.flash_attention(q, k, v, **kwargs)


class TestXlaCpuSmallBlocks(conformance.ConformanceSuite):
  """Many blocks per sequence: exercises skipping and partial tail blocks."""

  CAPS = conformance.Capabilities.of(xla_cpu.CAPABILITIES, name="xla_cpu[16x32]",
                                     max_seq_len=1000, hypothesis_examples=8)

  def attention(self, q, k, v, **kwargs):
    return xla_cpu.flash_attention(
        q, k, v, config=xla_cpu.XlaConfig(block_q=16, block_kv=32), **kwargs)


from flashjax.common import (conformance, conformance_kvcache, conformance_packed,
                             reference, tolerances)
