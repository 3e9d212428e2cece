"""The dK/dV kernel reading the additive tile transposed in registers ("new")
against XLA's transposed copy ("before", flashjax_prev: the tree at b42c531), one process;
forward+backward ms and the ratio before / new."""
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
cases = [(8, 2048, False, "bias"), (8, 2048, True, "bias"), (2, 8192, False, "bias"),
         (2, 8192, True, "bias"), (8, 2048, True, "mask")]
for b, s, causal, kind in cases:
  h, d = 16, 128
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  if kind == "bias":
    extra = (jax.random.normal(ks[4], (1, h, s, s), jnp.bfloat16),)
    kw = lambda x: dict(bias=x[0])
  else:
    mask = jax.random.bernoulli(ks[5], 0.9, (b, 1, s, s))
    extra, kw = (), lambda x: dict(mask=mask)

  def grad_of(mod):
    f = lambda *a: jnp.sum(f32(mod.flash_attention(*a[:3], causal=causal, **kw(a[3:])))
                           * f32(do))
    return jax.jit(jax.grad(f, tuple(range(3 + len(extra)))))

  args = (q, k, v) + extra
  calls = {"new": (grad_of(new), args), "before": (grad_of(old), args)}
  a, r = (calls[n][0](*args) for n in ("new", "before"))
  diff = " ".join(f"{n} {float(jnp.max(jnp.abs(f32(x) - f32(y)))):.1e}"
                  for n, x, y in zip(("dq", "dk", "dv", "dbias"), a, r))
  del a, r
  t = time_interleaved_ms(calls, iters=5, repeats=5)
  print(f"B{b} S{s}{' causal' if causal else ''} {kind} fwd+bwd ms: new {t['new']:.3f} "
        f"before {t['before']:.3f} ({t['before'] / t['new']:.3f}x) | max diff {diff}",
        flush=True)
