"""A shard of a split call drops exactly what the whole call drops there.

common/partition.py hands each shard's kernels ``dropout.shard_seed(seed, b0, h0)``
(its first global batch and query-head index). Here a slice of batch and heads runs
through each dropout-capable kernel platform with that seed, on one device, and must
equal the same slice of the reference on the whole problem: outputs and gradients.
The 4-device partitioned path itself is in sharding_test.py.
"""

import jax
import numpy as np
import pytest

from flashjax.common import dropout, reference, spec as spec_lib
from flashjax.pallas_gpu.triton import pallas_triton
from flashjax.pallas_tpu import attention as pallas_tpu

PLATFORMS = {"pallas-triton": pallas_triton.attention_from_operands,
             "pallas-tpu": pallas_tpu.attention_from_operands}
KW = dict(causal=True, dropout_rate=0.25, dropout_seed=123)


# (b0, h0): a shard's first global batch and query-head index.
OFFSETS = [(1, 2), (0, 4), (2, 0)]


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_shards_with_offsets_match_reference_slices(platform):
  """Each shard of ``OFFSETS``, with and without its offsets, in one program:
  the shards share their shapes, so the kernels trace and compile once."""
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (3, 40, 8, 32))
  k = jax.random.normal(ks[1], (3, 40, 4, 32))
  v = jax.random.normal(ks[2], (3, 40, 4, 32))
  do = jax.random.normal(ks[3], (3, 40, 8, 32))
  slices = [((slice(b0, b0 + 1), slice(None), slice(h0, h0 + 4)),
             (slice(b0, b0 + 1), slice(None), slice(h0 // 2, h0 // 2 + 2)))
            for b0, h0 in OFFSETS]

  def local(q, k, v, offsets):
    ops, spec = spec_lib.canonicalize(q, k, v, **KW)
    if offsets is not None:
      ops = ops._replace(dropout_seed=dropout.shard_seed(ops.dropout_seed, *offsets))
    return PLATFORMS[platform](ops, spec, interpret=True)[0]

  def shards(q, k, v, do):
    found = []
    for offsets, (qs, kvs) in zip(OFFSETS, slices):
      out, vjp = jax.vjp(lambda *a, o=offsets: local(*a, o), q[qs], k[kvs], v[kvs])
      # Control: without the offsets the same shard drops other entries.
      plain = local(q[qs], k[kvs], v[kvs], None)
      found.append((out, vjp(do[qs]), plain))
    return found

  def whole(q, k, v):
    return reference.attention(q, k, v, **KW)

  ref, ref_vjp = jax.vjp(jax.jit(whole), q, k, v)
  ref_grads = ref_vjp(do)
  for offsets, (qs, kvs), (out, grads, plain) in zip(
      OFFSETS, slices, jax.jit(shards)(q, k, v, do)):
    np.testing.assert_allclose(out, ref[qs], rtol=1e-4, atol=1e-5, err_msg=str(offsets))
    for g, r, s in zip(grads, ref_grads, (qs, kvs, kvs)):
      np.testing.assert_allclose(g, r[s], rtol=2e-4, atol=2e-4, err_msg=str(offsets))
    assert not np.allclose(plain, ref[qs], atol=1e-3), offsets
