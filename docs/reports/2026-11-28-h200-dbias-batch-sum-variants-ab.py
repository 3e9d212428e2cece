"""Variants of the dQ kernel's dS batch sum, one process: `flashjax` with two
dS stages (2026-11-28-h200-dbias-batch-sum-two-stages.patch), `flashjax_single`
with one (the version kept), `flashjax_noreduce` with plain stores instead of
reduce-adds (a wrong dbias, for timing only), `flashjax_prev` the per-row dS."""
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax.pallas_gpu.mosaic import config as c0
from flashjax_single.pallas_gpu import mosaic as single
from flashjax_single.pallas_gpu.mosaic import config as c1
from flashjax_noreduce.pallas_gpu import mosaic as noreduce
from flashjax_noreduce.pallas_gpu.mosaic import config as c2
from flashjax_prev.pallas_gpu import mosaic as old
for c in (c0, c1, c2):
  c.DBIAS_KERNEL_SUM_MIN_BATCH = 1
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
shapes = [(8, 2048, False), (8, 2048, True), (4, 4096, False), (4, 4096, True), (16, 1024, False), (32, 512, True)]
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
  calls = {"plain": (grad_of(new.flash_attention, False), (q, k, v)),
           "sum, 2 stages": (grad_of(new.flash_attention, True), (q, k, v, bias)),
           "sum, 1 stage": (grad_of(single.flash_attention, True), (q, k, v, bias)),
           "stores, 1 stage (wrong dbias)": (grad_of(noreduce.flash_attention, True), (q, k, v, bias)),
           "rows (before)": (grad_of(old.flash_attention, True), (q, k, v, bias))}
  a = calls["sum, 2 stages"][0](q, k, v, bias)
  r = calls["sum, 1 stage"][0](q, k, v, bias)
  err = lambda x, y: float(jnp.linalg.norm(f32(x) - f32(y)) / jnp.linalg.norm(f32(y)))
  line = "rel l2 2 stages vs 1: " + ", ".join(f"{err(x, y):.2e}" for x, y in zip(a, r))
  del a, r
  t = time_interleaved_ms(calls, iters=5, repeats=5)
  print(f"B{b} S{s}{' causal' if causal else ''} fwd+bwd ms: " + " | ".join(
      f"{n} {x:.3f}" for n, x in t.items())
      + f" | 2 stages over rows {t['rows (before)'] / t['sum, 2 stages']:.3f}x, 1 stage over rows {t['rows (before)'] / t['sum, 1 stage']:.3f}x | " + line, flush=True)
