"""The dQ kernel's dbias batch sum (threshold lowered to 1) against the per-row dS
and XLA's sum (threshold raised), same tree (HEAD) imported twice, one process."""
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as ksum
from flashjax.pallas_gpu.mosaic import config as c0
from flashjax_prev.pallas_gpu import mosaic as rows
from flashjax_prev.pallas_gpu.mosaic import config as c1
c0.DBIAS_KERNEL_SUM_MIN_BATCH = 1
c1.DBIAS_KERNEL_SUM_MIN_BATCH = 10 ** 6
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
shapes = [(4, 4096, True), (4, 4096, False), (6, 2048, True), (8, 2048, True), (8, 2048, False), (16, 1024, True), (2, 8192, True)]
for b, s, causal in shapes:
  h, d = 16, 128
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  bias = jax.random.normal(ks[4], (1, h, s, s), jnp.bfloat16)
  def grad_of(attn, with_bias):
    def f(q, k, v, *x):
      out = attn(q, k, v, causal=causal, **({"bias": x[0]} if with_bias else {}))
      return jnp.sum(f32(out) * f32(do))
    return jax.jit(jax.grad(f, (0, 1, 2, 3) if with_bias else (0, 1, 2)))
  calls = {"plain": (grad_of(ksum.flash_attention, False), (q, k, v)),
           "kernel sum": (grad_of(ksum.flash_attention, True), (q, k, v, bias)),
           "per-row dS": (grad_of(rows.flash_attention, True), (q, k, v, bias))}
  a = calls["kernel sum"][0](q, k, v, bias)
  r = calls["per-row dS"][0](q, k, v, bias)
  err = lambda x, y: float(jnp.linalg.norm(f32(x) - f32(y)) / jnp.linalg.norm(f32(y)))
  line = "rel l2 sum vs rows (dq dk dv dbias): " + ", ".join(f"{err(x, y):.1e}" for x, y in zip(a, r))
  del a, r
  t = time_interleaved_ms(calls, iters=5, repeats=5)
  print(f"B{b} S{s}{' causal' if causal else ''} fwd+bwd ms: " + " | ".join(
      f"{n} {x:.3f}" for n, x in t.items())
      + f" | kernel sum over per-row {t['per-row dS'] / t['kernel sum']:.3f}x | " + line, flush=True)
