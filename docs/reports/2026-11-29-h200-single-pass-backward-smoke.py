"""Single-pass vs two-kernel backward: max |grad - fp32 reference| per shape."""
import dataclasses, sys, time
import jax, jax.numpy as jnp
from flashjax.common import spec as spec_lib
from flashjax.pallas_gpu.mosaic import mosaic

def att(single):
  def fn(q, k, v, causal):
    spec = spec_lib.canonicalize(q, k, v, causal=causal)[1]
    cfg = dataclasses.replace(mosaic.default_config(spec), bwd_single_pass=single)
    return mosaic.flash_attention(q, k, v, causal=causal, config=cfg)
  return fn

def ref(q, k, v, causal):
  f = lambda x: x.astype(jnp.float32)
  hq, hk = q.shape[2], k.shape[2]
  k, v = (jnp.repeat(f(x), hq // hk, axis=2) for x in (k, v))
  return jax.nn.dot_product_attention(f(q), k, v, is_causal=causal, implementation="xla")

shapes = [(2, 1024, 4, 4, 128, False), (2, 1024, 4, 4, 128, True),
          (2, 1024, 4, 4, 64, True), (2, 1024, 8, 2, 128, True),
          (1, 2048, 4, 4, 128, False), (1, 300, 4, 2, 128, True)]
pick = [int(x) for x in sys.argv[1].split(",")] if sys.argv[1:] else range(len(shapes))
modes = sys.argv[2].split(",") if sys.argv[2:] else ["two", "single"]
for i, (b, s, hq, hk, d, causal) in enumerate(shapes):
  if i not in pick:
    continue
  ks = jax.random.split(jax.random.PRNGKey(i), 4)
  q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hk, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hk, d), jnp.bfloat16)
  do = jax.random.normal(ks[3], (b, s, hq, d), jnp.float32)
  def grads(fn):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, causal).astype(jnp.float32) * do)
    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  want = grads(ref)
  line = []
  for name, single in (("two", False), ("single", True)):
    if name not in modes:
      continue
    t = time.time()
    got = jax.block_until_ready(grads(att(single)))
    errs = [float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
            for g, w in zip(got, want)]
    line.append(f"{name} " + " ".join(f"{e:.2e}" for e in errs) + f" ({time.time() - t:.0f}s)")
  print((b, s, hq, hk, d, causal), " | ".join(line), flush=True)
