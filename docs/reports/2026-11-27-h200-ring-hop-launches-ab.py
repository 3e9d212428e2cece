"""Mosaic backward as one launch or two on the call shapes of a zigzag ring hop
(B1 H16 D128 bf16, 8k tokens per GPU): 8192 x 4096 and 4096 x 8192 full bands, the
own block (8192 causal), and 4096 x 4096; fwd+bwd (jax.grad) in interleaved rounds,
and the default forward alone."""
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic
print(jax.devices()[0].device_kind, flush=True)
for rnd in range(2):
  for sq, sk, causal in ((8192, 4096, False), (4096, 8192, False), (8192, 8192, True), (4096, 4096, False)):
    ks = jax.random.split(jax.random.key(rnd), 4)
    q, do = (jax.random.normal(kk, (1, sq, 16, 128), jnp.bfloat16) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (1, sk, 16, 128), jnp.bfloat16) for kk in ks[2:])
    calls = {}
    for name, one in (("one", True), ("two", False)):
      cfg = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(block_kv=128, num_stages=2), bwd_one_launch=one)
      f = lambda q, k, v, cfg=cfg: jnp.sum(mosaic.flash_attention(q, k, v, config=cfg, causal=causal).astype(jnp.float32) * do.astype(jnp.float32))
      calls[name] = (jax.jit(jax.grad(f, (0, 1, 2))), (q, k, v))
    calls["fwd"] = (jax.jit(lambda q, k, v: mosaic.flash_attention(q, k, v, causal=causal)), (q, k, v))
    t = time_interleaved_ms(calls, iters=10, repeats=5)
    print(f"round {rnd} Sq {sq} Sk {sk} causal {causal}: fwd {t['fwd']:.3f} fwd+bwd one {t['one']:.3f} two {t['two']:.3f} one/two {t['one']/t['two']:.3f}", flush=True)
