"""Per-kernel times (ncu) of forward+backward with a [1, H, S, S] bias: the
kernel's dS batch sum, the per-row dS (tree before), and the call without bias."""
import jax, jax.numpy as jnp
from tools.kernel_profile import _marker, _profiler
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old
start, stop = _profiler()
f32 = lambda x: x.astype(jnp.float32)
b, s, h, d = 8, 2048, 16, 128
for causal in (False, True):
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  bias = jax.random.normal(ks[4], (1, h, s, s), jnp.bfloat16)
  def grad_of(attn, with_bias):
    def f(q, k, v, *x):
      out = attn(q, k, v, causal=causal, **({"bias": x[0]} if with_bias else {}))
      return jnp.sum(f32(out) * f32(do))
    return jax.jit(jax.grad(f, (0, 1, 2, 3) if with_bias else (0, 1, 2)))
  for name, fn, args in (("plain", grad_of(new.flash_attention, False), (q, k, v)),
                         ("sum", grad_of(new.flash_attention, True), (q, k, v, bias)),
                         ("rows", grad_of(old.flash_attention, True), (q, k, v, bias))):
    jax.block_until_ready(fn(*args)); jax.block_until_ready(fn(*args))
    mark = _marker(f"{name}_{int(causal)}_bwd")
    start(); mark(); jax.block_until_ready(fn(*args)); stop()
