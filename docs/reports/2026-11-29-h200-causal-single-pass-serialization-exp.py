"""Backward variants side by side: two kernels, single pass, single pass with an env switch."""
import dataclasses, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
from flashjax.common import spec as spec_lib
from flashjax.pallas_gpu.mosaic import mosaic

VARIANTS = {"two": (False, {}), "sp": (True, {"FJ_EXP_WAIT_DV": "0"}),
            "spw": (True, {"FJ_EXP_WAIT_DV": "1"})}

def attention(single):
  def fn(q, k, v, causal):
    spec = spec_lib.canonicalize(q, k, v, causal=causal)[1]
    cfg = dataclasses.replace(mosaic.default_config(spec), bwd_single_pass=single)
    return mosaic.flash_attention(q, k, v, causal=causal, config=cfg)
  return fn

def inputs(b, s, hq, hk, d, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  mk = lambda key, h: jax.random.normal(key, (b, s, h, d), jnp.bfloat16)
  return mk(ks[0], hq), mk(ks[1], hk), mk(ks[2], hk), mk(ks[3], hq)

def build(name, q, k, v, causal):
  single, env = VARIANTS[name]
  os.environ.update(env)
  fn = attention(single)
  _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
  f = jax.jit(lambda vjp, do: vjp(do))
  return f, vjp

def bench(f, args, iters=10, reps=7):
  jax.block_until_ready(f(*args)); jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / iters * 1e3)
  return min(ts), float(np.median(ts))

mode = sys.argv[1]
names = sys.argv[2].split(",")
if mode == "dump":
  for causal in [bool(int(c)) for c in sys.argv[3].split(",")]:
    q, k, v, do = inputs(2, 1024, 4, 4, 128)
    for n in names:
      f, vjp = build(n, q, k, v, causal)
      jax.block_until_ready(f(vjp, do))
      print("dumped", n, causal, flush=True)
elif mode == "check":
  for (b, s, hq, hk, d, causal) in [(2, 1024, 4, 4, 128, True), (2, 1024, 4, 4, 128, False),
                                    (1, 2048, 8, 2, 128, True), (2, 1024, 4, 4, 64, True)]:
    q, k, v, do = inputs(b, s, hq, hk, d, seed=s + hq)
    res = {n: jax.block_until_ready(build(n, q, k, v, causal)[0](build(n, q, k, v, causal)[1], do)) for n in names}
    base = res[names[0]]
    for n in names[1:]:
      errs = [float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max() / jnp.abs(y.astype(jnp.float32)).max()) for x, y in zip(res[n], base)]
      print((b, s, hq, hk, d, causal), n, "vs", names[0], " ".join(f"{e:.2e}" for e in errs), flush=True)
else:
  shapes = [tuple(int(x) for x in sh.rstrip("c").split("x")[:5]) + (sh.endswith("c"),) for sh in sys.argv[3].split(",")]
  for (b, s, hq, hk, d, causal) in shapes:
    q, k, v, do = inputs(b, s, hq, hk, d)
    row = []
    for n in names:
      f, vjp = build(n, q, k, v, causal)
      mn, md = bench(f, (vjp, do))
      row.append(f"{n} {mn:.3f}/{md:.3f}")
    print(f"B{b} S{s} H{hq}:{hk} D{d} {'causal' if causal else 'full'}: " + " | ".join(row), flush=True)
