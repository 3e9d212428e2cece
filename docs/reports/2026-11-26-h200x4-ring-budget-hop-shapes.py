"""Time of the zigzag ring's hop shapes alone on one GPU (8k rows per GPU):

  CUDA_VISIBLE_DEVICES=0 python3 docs/reports/2026-11-26-h200x4-ring-budget-hop-shapes.py
"""
import os
import jax, jax.numpy as jnp
import flashjax
from flashjax.common import timer

H, D = 16, 128
def mk(s, seed):
  return jax.random.normal(jax.random.key(seed), (1, s, H, D), jnp.float32).astype(jnp.bfloat16)

shapes = {"rows-all x keys-half (src<r)": (8192, 4096, False),
          "rows-half x keys-all (src>r)": (4096, 8192, False),
          "own block causal": (8192, 8192, True)}
calls = {}
for name, (sq, sk, causal) in shapes.items():
  q, k, v, do = mk(sq, 0), mk(sk, 1), mk(sk, 2), mk(sq, 3)
  f = jax.jit(lambda q, k, v, c=causal: flashjax.flash_attention(q, k, v, causal=c))
  g = jax.jit(jax.grad(lambda q, k, v, do, c=causal: jnp.sum(
      flashjax.flash_attention(q, k, v, causal=c).astype(jnp.float32) * do.astype(jnp.float32)),
      argnums=(0, 1, 2)))
  calls[name, "fwd"] = (f, (q, k, v))
  calls[name, "fwd+bwd"] = (g, (q, k, v, do))
t = timer.time_interleaved_ms(calls, iters=20, repeats=5)
dev = os.environ.get("CUDA_VISIBLE_DEVICES")
for (name, d), ms in t.items():
  print(f"GPU {dev} {name:32s} {d:8s} {ms:.3f} ms")
