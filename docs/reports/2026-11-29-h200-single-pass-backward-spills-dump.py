"""Compiles (and runs once) the Mosaic backward at B2 S8k H16 D128 for a PTX dump."""
import dataclasses, os, sys
import jax, jax.numpy as jnp
from flashjax.pallas_gpu import mosaic
causal = sys.argv[1] == "1"
fused = len(sys.argv) > 2
cfg = mosaic.MosaicConfig()
if fused:
  os.environ["FJX_FUSED_EXP"] = sys.argv[2]
  cfg = dataclasses.replace(cfg, deterministic=False)
q = jax.random.normal(jax.random.key(0), (2, 8192, 16, 128), jnp.float32).astype(jnp.bfloat16)
f = lambda q, k, v: mosaic.flash_attention(q, k, v, causal=causal, config=cfg)
g = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)))
jax.block_until_ready(g(q, q, q)); print("ok", sys.argv[1:], flush=True)
