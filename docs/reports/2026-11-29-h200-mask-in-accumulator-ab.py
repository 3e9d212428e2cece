"""A mask alone starting the QK^T accumulator ("new", flashjax with
2026-11-29-h200-mask-in-accumulator.patch applied) against the mask tile added to
the scaled logits ("before", the tree without it, importable as flashjax_prev),
one process, interleaved; plus the call without a mask. Forward, then
forward+backward (grad in q, k, v)."""
import jax, jax.numpy as jnp
from flashjax.pallas_gpu.mosaic import flash_attention as new
from flashjax_prev.pallas_gpu.mosaic import flash_attention as old
from flashjax.common.timer import time_interleaved_ms

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
H, D = 16, 128
for b, s, causal in [(8, 2048, False), (8, 2048, True), (2, 8192, False), (2, 8192, True)]:
  ks = jax.random.split(jax.random.key(0), 5)
  q, k, v, do = (jax.random.normal(x, (b, s, H, D), jnp.float32).astype(jnp.bfloat16)
                 for x in ks[:4])
  mask = jax.random.bernoulli(ks[4], 0.9, (b, 1, s, s))
  fns = {"plain": lambda q, k, v, m: new(q, k, v, causal=causal),
         "mask new": lambda q, k, v, m: new(q, k, v, mask=m, causal=causal),
         "mask before": lambda q, k, v, m: old(q, k, v, mask=m, causal=causal)}
  fwd = {n: (jax.jit(f), (q, k, v, mask)) for n, f in fns.items()}
  fb = {n: (jax.jit(jax.grad(lambda q, k, v, m, f=f: jnp.sum(f32(f(q, k, v, m)) * f32(do)),
                             (0, 1, 2))), (q, k, v, mask)) for n, f in fns.items()}
  o_new, o_old = (fwd[n][0](q, k, v, mask) for n in ("mask new", "mask before"))
  g_new, g_old = (fb[n][0](q, k, v, mask) for n in ("mask new", "mask before"))
  diff = " ".join(f"{n} {float(jnp.max(jnp.abs(f32(x) - f32(y)))):.1e}" for n, x, y in
                  zip(("o", "dq", "dk", "dv"), (o_new,) + tuple(g_new), (o_old,) + tuple(g_old)))
  nan = any(bool(jnp.isnan(f32(x)).any()) for x in (o_new,) + tuple(g_new))
  del o_new, o_old, g_new, g_old
  label = f"B{b} S{s // 1024}k" + (" causal" if causal else "")
  for direction, calls in (("fwd", fwd), ("fwd+bwd", fb)):
    t = time_interleaved_ms(calls, iters=10, repeats=5)
    print(f"{label:14s} {direction:8s} plain {t['plain']:.3f} | mask new {t['mask new']:.3f} "
          f"({t['plain'] / t['mask new']:.3f}x plain) | before {t['mask before']:.3f} "
          f"({t['plain'] / t['mask before']:.3f}x plain) | new/before speed "
          f"{t['mask before'] / t['mask new']:.3f}x", flush=True)
  print(f"{label:14s} max|new - before| {diff} | nan {nan}", flush=True)
