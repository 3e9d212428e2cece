"""Mosaic backward: one launch against the dQ and dK/dV kernels as two launches,
with their grids' tiles last (fastest on the GPU) and, as before, batch last;
cuDNN and flash-attn3-jax in the same process. fwd+bwd (jax.grad) and the
forward alone, ms, interleaved rounds."""
import dataclasses
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic
from flashjax.pallas_gpu.mosaic import bwd
import flash_attn3_jax

_launch, reverse = bwd._launch, [False]


def launch(entry, out_type, grid, names):  # the grid order before this change
  if reverse[0]:
    grid, names = grid[::-1], names[::-1]
  return _launch(entry, out_type, grid, names)


bwd._launch = launch
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
SHAPES = [(8, 2048, 16, 16, 128), (2, 8192, 16, 16, 128), (1, 16384, 16, 16, 128),
          (2, 8192, 32, 8, 128), (2, 8192, 32, 32, 64)]
for (b, s, hq, hkv, d) in SHAPES:
  for causal in (False, True):
    ks = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(kk, (b, s, hq, d), jnp.bfloat16) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16) for kk in ks[2:])
    grad_of = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), (0, 1, 2)))
    calls = {
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"),
        "fa3": lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal)}
    base = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(block_kv=128, num_stages=3)
                               if d == 64 else mosaic.MosaicForward(block_kv=128, num_stages=2))
    for name, one, rev in (("one launch", True, False), ("two, tiles last", False, False),
                           ("two, batch last", False, True)):
      cfg = dataclasses.replace(base, bwd_one_launch=one)
      calls[name] = (lambda cfg: lambda q, k, v: mosaic.flash_attention(
          q, k, v, causal=causal, config=cfg))(cfg)
    grads, ref = {}, None
    for name, f in calls.items():
      if d != 128 and name == "fa3":
        continue
      reverse[0] = name == "two, batch last"
      g = grad_of(f)
      out = jax.block_until_ready(g(q, k, v))  # traced with this grid order
      if ref is None:
        ref = out
      err = max(float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max())
                for x, y in zip(out, ref))
      grads[name] = ((g, (q, k, v)), err)
    reverse[0] = False
    t = time_interleaved_ms({n: c for n, (c, _) in grads.items()}, iters=10, repeats=5)
    tf = time_interleaved_ms({n: (jax.jit(calls[n]), (q, k, v)) for n in
                              (["cudnn", "fa3", "one launch"] if "fa3" in grads
                               else ["cudnn", "one launch"])}, iters=10, repeats=5)
    label = f"B{b} S{s} H{hq}:{hkv} D{d}{' causal' if causal else ''}"
    print(f"{label:28s} fwd ms " + " | ".join(f"{n} {x:.3f}" for n, x in tf.items()), flush=True)
    print(f"{label:28s} fwd+bwd ms " + " | ".join(
        f"{n} {x:.3f} (err {grads[n][1]:.2g})" for n, x in t.items()), flush=True)
    ours_fwd = tf["one launch"]
    bw = {n: x - tf.get(n, ours_fwd) for n, x in t.items()}
    print(f"{label:28s} bwd ms (fwd+bwd - fwd) " + " | ".join(
        f"{n} {x:.3f} ({bw['cudnn'] / x:.3f}x cudnn)" for n, x in bw.items()), flush=True)
