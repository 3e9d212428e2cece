"""Mosaic forward on packed rows: kv ids streamed for every step ("before", the
tree importable as ``flashjax_prev``) or only for the steps either warpgroup
masks ("now", ``flashjax`` with 2026-11-27-h200-packed-forward-ids.patch
applied). Full calls, interleaved rounds; out and lse compared bitwise."""
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
CASES = [((2048,) * 8, True), ((512,) * 32, True), (shapes.MIXED_16K, True),
         ((2048,) * 8, False), ((512,) * 32, False)]
for docs, causal in CASES:
  s, h, d = sum(docs), 16, 128
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (1, s, h, d), jnp.bfloat16) for kk in ks)
  ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None].astype(np.int32))
  f = lambda m: jax.jit(lambda q, k, v: m.flash_attention(
      q, k, v, causal=causal, segment_ids=(ids, ids), return_lse=True))
  calls = {"before": (f(old), (q, k, v)), "now": (f(new), (q, k, v))}
  (o1, l1), (o2, l2) = (jax.block_until_ready(c(*a)) for c, a in calls.values())
  same = bool(jnp.array_equal(o1, o2)) and bool(jnp.array_equal(l1, l2))
  t = time_interleaved_ms(calls, iters=20, repeats=7)
  label = f"{len(docs)} docs{' causal' if causal else ''}"
  print(f"{label:18s} fwd ms before {t['before']:.4f} | now {t['now']:.4f} | "
        f"before/now {t['before'] / t['now']:.3f} | out, lse bit-equal {same}", flush=True)
