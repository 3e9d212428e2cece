"""A/B of the dQ kernel's dS batch sum (Geometry.ds_batch_sum) against the
per-row bf16 dS that XLA sums, forward+backward with a [1, H, S, S] bf16 bias.
`flashjax_prev` is the tree before the change. The threshold is lowered to 1 so
that every shape here takes the sum, and the crossover shows."""
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.common import reference
from flashjax.pallas_gpu import mosaic as new
from flashjax.pallas_gpu.mosaic import config as new_config
from flashjax_prev.pallas_gpu import mosaic as old

new_config.DBIAS_KERNEL_SUM_MIN_BATCH = 1
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
for b, s, causal in ((8, 2048, False), (8, 2048, True), (2, 8192, False),
                     (2, 8192, True), (4, 4096, False), (16, 1024, True)):
  h, d = 16, 128
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  bias = jax.random.normal(ks[4], (1, h, s, s), jnp.bfloat16)

  def grad_of(attn, with_bias):
    def f(q, k, v, *x):
      out = attn(q, k, v, causal=causal, **({"bias": x[0]} if with_bias else {}))
      return jnp.sum(f32(out) * f32(do))
    return jax.jit(jax.grad(f, (0, 1, 2, 3) if with_bias else (0, 1, 2)))
  calls = {"plain": (grad_of(new.flash_attention, False), (q, k, v)),
           "bias, kernel sum": (grad_of(new.flash_attention, True), (q, k, v, bias)),
           "bias, rows (before)": (grad_of(old.flash_attention, True), (q, k, v, bias))}
  a = calls["bias, kernel sum"][0](q, k, v, bias)
  r = calls["bias, rows (before)"][0](q, k, v, bias)
  err = lambda x, y: float(jnp.linalg.norm(f32(x) - f32(y)) / jnp.linalg.norm(f32(y)))
  line = ("rel l2 new vs before dq,dk,dv,dbias: "
          + ", ".join(f"{err(x, y):.2e}" for x, y in zip(a, r)))
  if b * s <= 16384 and s <= 2048:
    ref = jax.jit(jax.grad(lambda bias: jnp.sum(f32(reference.attention(
        f32(q), f32(k), f32(v), bias=f32(bias), causal=causal)) * f32(do))))(bias)
    line += f" | dbias vs fp32 reference: new {err(a[3], ref):.2e}, before {err(r[3], ref):.2e}"
  del a, r
  t = time_interleaved_ms(calls, iters=5, repeats=5)
  print(f"B{b} S{s} H{h} D{d}{' causal' if causal else ''} fwd+bwd ms: " + " | ".join(
      f"{n} {x:.3f} ({t['plain'] / x:.3f}x plain)" for n, x in t.items())
      + f" | new over before {t['bias, rows (before)'] / t['bias, kernel sum']:.3f}x | "
      + line, flush=True)
