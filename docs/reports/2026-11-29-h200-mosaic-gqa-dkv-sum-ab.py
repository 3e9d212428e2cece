"""dK/dV summed over each kv head's query heads inside the Mosaic-GPU dK/dV kernel
("new", flashjax) against per-query-head outputs summed by XLA ("before", the
tree before the change importable as flashjax_prev), one process, interleaved:
forward+backward ms; then dK and dV errors of both against an fp32 XLA
reference on a smaller shape."""
import jax, jax.numpy as jnp
from flashjax.pallas_gpu.mosaic import flash_attention as new
from flashjax_prev.pallas_gpu.mosaic import flash_attention as old
from flashjax.common.timer import time_interleaved_ms

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)


def inputs(b, s, hq, hkv, d, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, s, hq, d), jnp.float32).astype(jnp.bfloat16)
  k, v = (jax.random.normal(x, (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
          for x in ks[1:3])
  do = jax.random.normal(ks[3], (b, s, hq, d), jnp.float32).astype(jnp.bfloat16)
  return q, k, v, do


def grad_of(f, do, **kw):
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f32(f(q, k, v, **kw)) * f32(do)),
                          (0, 1, 2)))


for b, s, hq, hkv, d, causal in [(2, 8192, 32, 8, 128, False), (2, 8192, 32, 8, 128, True),
                                 (2, 8192, 16, 16, 128, True), (2, 8192, 32, 8, 64, True),
                                 (2, 4096, 16, 4, 256, True), (8, 2048, 32, 4, 128, True)]:
  q, k, v, do = inputs(b, s, hq, hkv, d)
  calls = {n: (grad_of(f, do, causal=causal), (q, k, v)) for n, f in (("new", new), ("before", old))}
  gn, go = (calls[n][0](q, k, v) for n in ("new", "before"))
  diff = " ".join(f"{n} {float(jnp.max(jnp.abs(f32(x) - f32(y)))):.1e}"
                  for n, x, y in zip(("dq", "dk", "dv"), gn, go))
  del gn, go
  t = time_interleaved_ms(calls, iters=10, repeats=5)
  print(f"B{b} S{s} H{hq}:{hkv} D{d}{' causal' if causal else ''}: fwd+bwd new {t['new']:.3f} ms "
        f"before {t['before']:.3f} ms ({t['before'] / t['new']:.3f}x) | max|new-before| {diff}",
        flush=True)

# Errors against fp32 (XLA, the inputs' bf16 values in fp32).
for hq, hkv in [(32, 8), (32, 4), (16, 1)]:
  q, k, v, do = inputs(1, 2048, hq, hkv, 128, seed=1)
  ref = grad_of(lambda q, k, v, causal: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="xla"), f32(do), causal=True)(
          f32(q), f32(k), f32(v))
  line = []
  for n, f in (("new", new), ("before", old)):
    g = grad_of(f, do, causal=True)(q, k, v)
    line.append(n + " " + " ".join(
        f"{w} max {float(jnp.max(jnp.abs(f32(x) - y))):.2e} mean {float(jnp.mean(jnp.abs(f32(x) - y))):.2e}"
        for w, x, y in zip(("dk", "dv"), g[1:], ref[1:])))
  print(f"B1 S2048 H{hq}:{hkv} causal, |grad - fp32 reference|: " + " | ".join(line), flush=True)
