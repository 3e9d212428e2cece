"""The D = 64 backward's dQ kernel with 128-key blocks (``dq.block_kv=128``)
against the default 64-key blocks, with cuDNN in the same rounds: forward +
backward (``jax.grad``) at B2 S8k H32, causal and not, interleaved rounds."""
import dataclasses
import jax, jax.numpy as jnp
from flashjax.common import spec as spec_lib
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic
from flashjax.pallas_gpu.mosaic import config as mosaic_config

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
for causal in (False, True):
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (2, 8192, 32, 64), jnp.bfloat16) for kk in ks)
  spec = spec_lib.canonicalize(q, k, v, causal=causal)[1]
  base = mosaic_config.default_config(spec)
  wide = dataclasses.replace(base, dq=dataclasses.replace(base.dq, block_kv=128))
  arms = {
      "default": lambda q, k, v: mosaic.flash_attention(q, k, v, causal=causal, config=base),
      "dq 128": lambda q, k, v: mosaic.flash_attention(q, k, v, causal=causal, config=wide),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")}
  grad = {n: (jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(
      f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), (0, 1, 2))), (q, k, v))
      for n, f in arms.items()}
  res = {n: jax.block_until_ready(f(*x)) for n, (f, x) in grad.items()}
  err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(res["default"], res["dq 128"]))
  t = time_interleaved_ms(grad, iters=10, repeats=7)
  line = " | ".join(f"{n} {ms:.3f}" for n, ms in t.items())
  print(f"B2 S8k H32 D64 {'causal' if causal else 'full  '} fwd+bwd ms {line} | "
        f"default/dq128 {t['default'] / t['dq 128']:.3f} | x cudnn default "
        f"{t['cudnn'] / t['default']:.3f} dq128 {t['cudnn'] / t['dq 128']:.3f} | "
        f"max |grad diff| {err:.3g}", flush=True)
