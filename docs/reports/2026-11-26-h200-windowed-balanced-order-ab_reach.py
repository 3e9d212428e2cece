"""Where the persistent balanced causal forward pays: default vs persistent=True."""
import jax, jax.numpy as jnp
from flashjax.common import configs, spec as spec_lib
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import mosaic
try:
  import flash_attn3_jax
except Exception:
  flash_attn3_jax = None
print(jax.devices(), flush=True)
for B, S, H, D in [(2, 8192, 16, 128), (4, 4096, 16, 128), (1, 16384, 32, 64), (2, 8192, 32, 64),
                   (8, 2048, 8, 256), (4, 4096, 8, 256), (2, 8192, 8, 256)]:
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
  spec = spec_lib.canonicalize(q, k, v, causal=True)[1]
  base = mosaic.default_config(spec)
  f = lambda cfg: jax.jit(lambda q, k, v: mosaic.flash_attention(q, k, v, causal=True, config=cfg))
  calls = {"one per tile": (f(configs.with_part(base, "fwd", persistent=False)), (q, k, v)),
           "persistent": (f(configs.with_part(base, "fwd", persistent=True)), (q, k, v))}
  if flash_attn3_jax is not None:
    calls["fa3"] = (jax.jit(lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=True)), (q, k, v))
  default_p = bool(mosaic.geometry(spec, base).persistent_ctas)
  t = time_interleaved_ms(calls, iters=20, repeats=9)
  b = t["one per tile"]
  print(f"B{B} S{S} H{H} D{D} default persistent={default_p} " + " | ".join(
      f"{n} {x:.4f} ms ({b / x:.3f}x)" if isinstance(x, float) else f"{n} {x!r}"
      for n, x in t.items()), flush=True)
