"""The additive tile's logits in one FMA ("fma") against the tree before
("before", commit 4214e78, importable as flashjax_prev), one process; ratios to
the call without a bias or mask.

  python3 2026-11-28-h200-bias-logits-fma-ab.py [fwd|bwd]
"""
import sys
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
which = sys.argv[1]
shapes = [(8, 2048, False), (8, 2048, True), (2, 8192, False), (2, 8192, True)]
for b, s, causal in shapes:
  h, d = 16, 128
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  bias = jax.random.normal(ks[4], (1, h, s, s), jnp.bfloat16)
  mask = jax.random.bernoulli(ks[5], 0.9, (b, 1, s, s))

  def build(mod, block_kv=None, **kw):
    cfg = None if block_kv is None else mod.MosaicConfig(fwd=mod.MosaicForward(block_kv=block_kv))
    def fwd(q, k, v, *x):
      extra = dict(kw)
      if x:
        extra["bias"] = x[0]
      return mod.flash_attention(q, k, v, causal=causal, config=cfg, **extra)
    with_bias = kw.pop("bias", None) is not None
    args = (q, k, v) + ((bias,) if with_bias else ())
    if which == "fwd":
      fn = fwd
    else:
      fn = jax.grad(lambda *a: jnp.sum(f32(fwd(*a)) * f32(do)), tuple(range(len(args))))
    return jax.jit(fn), args

  calls = {"plain": build(new),
           "bias 128 fma": build(new, bias=bias),
           "bias 128 before": build(old, bias=bias),
           "bias 64 fma": build(new, 64, bias=bias),
           "mask fma": build(new, mask=mask),
           "mask before": build(old, mask=mask)}
  out = {n: f(*a) for n, (f, a) in calls.items()}
  err = lambda x, y: float(jnp.max(jnp.abs(f32(x) - f32(y))))
  errs = f"max|fma - before| bias {err(jax.tree.leaves(out['bias 128 fma'])[0], jax.tree.leaves(out['bias 128 before'])[0]):.2e}"
  del out
  t = time_interleaved_ms(calls, iters=10, repeats=5)
  base = t["plain"]
  print(f"{which} B{b} S{s}{' causal' if causal else ''} ms: " + " | ".join(
      f"{n} {x:.3f} ({base / x:.3f})" for n, x in t.items()) + " | " + errs, flush=True)
