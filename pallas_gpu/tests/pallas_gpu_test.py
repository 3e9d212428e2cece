"""Until kernels land, both Pallas GPU families must refuse every call with a reason."""

import jax.numpy as jnp
import pytest

from flashjax.common import spec
from flashjax.pallas_gpu import mosaic, pallas_triton


@pytest.mark.parametrize("mod", [mosaic, pallas_triton])
def test_refuses_with_reason(mod):
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="not implemented"):
    mod.flash_attention(q, q, q)
  _, s = spec.canonicalize(q, q, q)
  assert "not implemented" in mod.supported(s)
