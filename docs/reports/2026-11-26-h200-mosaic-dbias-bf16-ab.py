import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
for b, s, causal in ((8, 2048, False), (8, 2048, True), (2, 8192, False), (2, 8192, True)):
  h, d = 16, 128
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  bias = jax.random.normal(ks[4], (1, h, s, s), jnp.bfloat16)
  def grad_of(attn, with_bias):
    def f(q, k, v, *x):
      out = attn(q, k, v, causal=causal, **({"bias": x[0]} if with_bias else {}))
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(f, (0, 1, 2, 3) if with_bias else (0, 1, 2)))
  calls = {"plain": (grad_of(new.flash_attention, False), (q, k, v)),
           "bias, dS bf16": (grad_of(new.flash_attention, True), (q, k, v, bias)),
           "bias, dS fp32 (before)": (grad_of(old.flash_attention, True), (q, k, v, bias))}
  a, r = calls["bias, dS bf16"][0](q, k, v, bias), calls["bias, dS fp32 (before)"][0](q, k, v, bias)
  f32 = lambda x: x.astype(jnp.float32)
  rel = [float(jnp.linalg.norm(f32(x) - f32(y)) / jnp.linalg.norm(f32(y))) for x, y in zip(a, r)]
  t = time_interleaved_ms(calls, iters=5, repeats=5)
  print(f"B{b} S{s} H{h} D{d}{' causal' if causal else ''} fwd+bwd ms: " + " | ".join(
      f"{n} {x:.3f} ({t['plain'] / x:.2f}x plain)" for n, x in t.items())
      + " | rel l2 new vs before dq,dk,dv,dbias: " + ", ".join(f"{e:.2e}" for e in rel), flush=True)
