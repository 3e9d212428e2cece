"""Eager (unjitted) flash_attention calls on the xla platform, time per call.

  python docs/reports/2026-11-28-cpu-eager-calls.py

Run once per tree, each with its own ``flashjax`` on the path; fp32, causal,
B1 S256 H4 D64; median of 5 samples of 20 forwards / 10 gradients.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import flashjax

print(flashjax.__file__)
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(x, (1, 256, 4, 64), jnp.float32) for x in keys)


def per_call(fn, calls):
  jax.block_until_ready(fn())
  samples = []
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t) / calls * 1e3)
  return round(float(np.median(samples)), 3)


attend = lambda q: flashjax.flash_attention(q, k, v, causal=True, platform="xla")
grad = jax.grad(lambda q: attend(q).sum())
print("eager ms per call", per_call(lambda: attend(q), 20))
print("eager grad ms per call", per_call(lambda: grad(q), 10))
