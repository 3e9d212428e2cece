"""Until kernels land, the platform must refuse every call with a reason."""

import jax.numpy as jnp
import pytest

from flashjax import triton_gpu
from flashjax.common import spec


def test_refuses_with_reason():
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="triton_gpu"):
    triton_gpu.flash_attention(q, q, q)
  _, s = spec.canonicalize(q, q, q)
  assert "triton_gpu" in triton_gpu.supported(s)
