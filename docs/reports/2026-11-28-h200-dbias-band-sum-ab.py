"""dbias summed by dbias_sum's kernel, which reads only the band's reached dS tiles
("new"), against XLA's sum, which read all of dS and zeroed the unreached tiles in
its read ("before", flashjax_prev at 0a5df60), one process; forward+backward ms."""
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
cases = [(2, 8192, dict(causal=True), (1, 16)), (4, 4096, dict(causal=True), (1, 16)),
         (2, 8192, dict(sliding_window=(2048, 0)), (1, 16)),
         (4, 4096, dict(causal=True), (4, 1)), (2, 8192, dict(), (1, 16))]
for b, s, band, bias_bh in cases:
  h, d = 16, 128
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  bias = jax.random.normal(ks[4], bias_bh + (s, s), jnp.bfloat16)

  def grad_of(mod):
    f = lambda q, k, v, bias: jnp.sum(
        f32(mod.flash_attention(q, k, v, bias=bias, **band)) * f32(do))
    return jax.jit(jax.grad(f, (0, 1, 2, 3)))

  args = (q, k, v, bias)
  calls = {"new": (grad_of(new), args), "before": (grad_of(old), args)}
  a, r = (calls[n][0](*args) for n in ("new", "before"))
  diff = " ".join(f"{n} {float(jnp.max(jnp.abs(f32(x) - f32(y)))):.1e}"
                  for n, x, y in zip(("dq", "dk", "dv", "dbias"), a, r))
  nan = any(bool(jnp.isnan(f32(x)).any()) for x in a)
  del a, r
  t = time_interleaved_ms(calls, iters=5, repeats=5)
  print(f"B{b} S{s} {band} bias {bias_bh} fwd+bwd ms: new {t['new']:.3f} "
        f"before {t['before']:.3f} ({t['before'] / t['new']:.3f}x) | max diff {diff}"
        f" | nan {nan}", flush=True)
