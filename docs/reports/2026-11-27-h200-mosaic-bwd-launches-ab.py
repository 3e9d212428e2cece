"""Mosaic backward as one launch (the default) or two (dQ, then dK/dV; grids
tiles last), fwd+bwd (jax.grad) in interleaved rounds, on plain and packed
rows (segment ids)."""
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
CASES = [(2, 8192, 16, 16, False, None), (2, 8192, 16, 16, True, None),
         (1, 16384, 16, 16, False, None), (1, 16384, 16, 16, True, None),
         (2, 8192, 32, 8, False, None), (8, 2048, 16, 16, True, None),
         (1, 16384, 16, 16, False, (2048,) * 8), (1, 16384, 16, 16, True, (2048,) * 8),
         (1, 16384, 16, 16, True, (512,) * 32), (1, 16384, 16, 16, True, shapes.MIXED_16K)]
for rnd in range(2):
  for b, s, hq, hkv, causal, docs in CASES:
    d = 128
    ks = jax.random.split(jax.random.key(rnd), 4)
    q, do = (jax.random.normal(kk, (b, s, hq, d), jnp.bfloat16) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16) for kk in ks[2:])
    kw = dict(causal=causal)
    if docs is not None:
      ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None].astype(np.int32))
      kw["segment_ids"] = (ids, ids)
    calls = {}
    for name, one in (("one launch", True), ("two launches", False)):
      cfg = dataclasses.replace(
          mosaic.MosaicConfig(fwd=mosaic.MosaicForward(block_kv=128, num_stages=2)),
          bwd_one_launch=one)
      f = lambda q, k, v, cfg=cfg: jnp.sum(mosaic.flash_attention(
          q, k, v, config=cfg, **kw).astype(jnp.float32) * do.astype(jnp.float32))
      calls[name] = (jax.jit(jax.grad(f, (0, 1, 2))), (q, k, v))
    a, c = (jax.block_until_ready(fn(*args)) for fn, args in calls.values())
    same = all(bool(jnp.array_equal(x, y)) for x, y in zip(a, c))
    t = time_interleaved_ms(calls, iters=10, repeats=5)
    label = (f"B{b} S{s} H{hq}:{hkv}" + (f" {len(docs)} docs" if docs else "")
             + (" causal" if causal else ""))
    print(f"round {rnd} {label:32s} fwd+bwd ms one {t['one launch']:.3f} | two "
          f"{t['two launches']:.3f} | one/two {t['one launch'] / t['two launches']:.3f}"
          f" | grads bit-equal {same}", flush=True)
