"""The conformance suite on xla_cpu, plus what is specific to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import xla_cpu
from flashjax.common import (conformance, conformance_kvcache, conformance_packed,
                             reference, tolerances)

# Forward and backward blocks differ, so the backward cannot lean on the
# forward's blocking (the lse is per row, whatever the blocks).
SMALL = xla_cpu.XlaConfig(fwd=xla_cpu.BlockSizes(block_q=16, block_kv=32),
                          bwd=xla_cpu.BlockSizes(block_q=32, block_kv=16))


class TestXlaCpu(conformance.ConformanceSuite):
  CAPS = conformance.Capabilities.of(xla_cpu.CAPABILITIES, name="xla_cpu")

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


from flashjax.common import (conformance, conformance_kvcache, conformance_packed,
                             reference, tolerances)
