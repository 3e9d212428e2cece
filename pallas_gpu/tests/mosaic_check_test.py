"""Smoke check of the Mosaic-GPU platform on a Hopper GPU, independent of the
conformance suite's machinery: relative error of out and lse against the fp32
reference on a spread of shapes and features, and of dq/dk/dv on most of them
(the Mosaic backward, its warpgroups in roles at D = 256).

  pytest pallas_gpu/tests/mosaic_check_test.py   # on a Hopper GPU
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import hardware, reference
from flashjax.pallas_gpu import mosaic

ON_HOPPER = jax.default_backend() == "gpu" and hardware.is_hopper()

# bf16 inputs against the fp32 reference, in relative Frobenius norm.
REL_TOL = 2e-2

CASES = [
    dict(S=512, D=128), dict(S=512, D=128, causal=True), dict(S=1024, D=64, causal=True),
    dict(S=512, D=256), dict(S=300, Sk=700, D=96, sliding_window=(100, 20)),
    dict(S=700, Sk=300, D=128, causal=True), dict(S=256, D=128, H=4, Hkv=1,
                                                  logits_soft_cap=20.0),
    dict(S=384, D=128, sinks=True, causal=True), dict(S=2048, D=128, causal=True, B=2),
    dict(S=200, D=64, sliding_window=(0, 0)),
    # Dropout: at D = 64 over 2304 keys the default persistent forward splits its
    # last round by keys (the parts merged after); at D = 256 the backward's
    # P warpgroups hash and hand the drops over as signs.
    dict(S=2304, D=64, dropout_rate=0.2, dropout_seed=7),
    dict(S=512, D=256, causal=True, dropout_rate=0.1, dropout_seed=3),
]

GRAD_CASES = (1, 2, 3, 4, 5, 6, 7, 9, 10, 11)


def rel(a, b, floor_rms=1e-3):
  """Relative error over the finite entries of b; inf if the finite sets differ.
  The reference's norm is floored at an RMS of ``floor_rms`` per entry: with a
  window of one key (0, 0) every row's softmax is one-hot, dq and dk are exactly
  zero, and the kernel's bf16 rounding of dP - delta (RMS ~1e-7 there, H200
  2026-11-24) must not read as an infinite relative error."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  fin = np.isfinite(b)
  if not np.array_equal(np.isfinite(a), fin):
    return float("inf")
  floor = floor_rms * np.sqrt(max(int(fin.sum()), 1))
  return float(np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), floor))


def errors(case, grad=False):
  """Relative errors of out and lse (and dq, dk, dv with ``grad``)."""
  c = dict(case)
  b, s = c.pop("B", 1), c.pop("S")
  sk, d, h = c.pop("Sk", s), c.pop("D"), c.pop("H", 2)
  hkv = c.pop("Hkv", h)
  keys = jax.random.split(jax.random.key(s + d), 5)
  q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, sk, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, sk, hkv, d), jnp.bfloat16)
  if c.pop("sinks", False):
    c["sinks"] = jax.random.normal(keys[3], (h, 1), jnp.float32)
  f = jax.jit(lambda q, k, v: mosaic.flash_attention(q, k, v, return_lse=True, **c))
  out, lse = f(q, k, v)
  up = lambda x: x.astype(jnp.float32)
  r_out, r_lse = reference.attention(up(q), up(k), up(v), return_lse=True, **c)
  errs = {"out": rel(out, r_out), "lse": rel(lse, r_lse)}
  if grad:
    do = jax.random.normal(keys[4], out.shape, jnp.bfloat16)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(up(mosaic.flash_attention(
        q, k, v, **c)) * up(do)), argnums=(0, 1, 2)))(q, k, v)
    rg = jax.grad(lambda q, k, v: jnp.sum(reference.attention(q, k, v, **c) * up(do)),
                  argnums=(0, 1, 2))(up(q), up(k), up(v))
    errs.update({n: rel(x, y) for n, x, y in zip(("dq", "dk", "dv"), g, rg)})
  return errs


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU; Mosaic-GPU has no "
                    "interpret mode for wgmma/TMA/barriers")
@pytest.mark.parametrize("i", range(len(CASES)))
def test_mosaic_matches_the_reference(i):
  errs = errors(CASES[i], grad=i in GRAD_CASES)
  assert all(e < REL_TOL for e in errs.values()), (CASES[i], errs)
