"""A/B of the Mosaic-GPU mask tile: run as ``python3 <this> TREE`` with the
flashjax tree to measure first on PYTHONPATH (as ``flashjax``), once per tree,
alternating trees. Each process times, per shape, in interleaved rounds: the
plain call, the call with a dense [B, 1, S, S] mask (90% kept), the masked call
with the forward's 64-key tiles pinned (where the tree allows a choice), and
the call with a trained [1, H, S, S] bias; forward, then forward + backward
(jax.grad in q, k, v and the bias). Prints one line per entry with its time and
the plain call's time over it.

Ran at the trees of 2026-11-28 before config.MASK_FORWARD was renamed
(main before 4214e78); later trees skip the pinned 64-key entry."""

import sys

import jax
import jax.numpy as jnp

from flashjax import flash_attention
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import config as mcfg

TREE = sys.argv[1]
SHAPES = [(8, 2048, False), (8, 2048, True), (2, 8192, False), (2, 8192, True)]
H, D = 16, 128


def main():
  for b, s, causal in SHAPES:
    keys = jax.random.split(jax.random.key(0), 6)
    q, k, v, do = (jax.random.normal(x, (b, s, H, D), jnp.float32).astype(jnp.bfloat16)
                   for x in keys[:4])
    mask = jax.random.bernoulli(keys[4], 0.9, (b, 1, s, s))
    bias = jax.random.normal(keys[5], (1, H, s, s), jnp.float32).astype(jnp.bfloat16)
    pinned = mcfg.MosaicConfig(fwd=mcfg.MosaicForward(block_kv=64, num_stages=2))
    entries = {
        "plain": lambda q, k, v, m, c: flash_attention(q, k, v, causal=causal,
                                                       platform="pallas"),
        "mask": lambda q, k, v, m, c: flash_attention(q, k, v, mask=m, causal=causal,
                                                      platform="pallas"),
        "bias": lambda q, k, v, m, c: flash_attention(q, k, v, bias=c, causal=causal,
                                                      platform="pallas"),
    }
    if hasattr(mcfg, "MASK_FORWARD"):
      entries["mask, 64-key fwd"] = lambda q, k, v, m, c: flash_attention(
          q, k, v, mask=m, causal=causal, platform="pallas", config=pinned)
    fwd, fb = {}, {}
    for name, f in entries.items():
      fwd[name] = (jax.jit(f), (q, k, v, mask, bias))
      loss = lambda q, k, v, m, c, f=f: jnp.sum(
          f(q, k, v, m, c).astype(jnp.float32) * do.astype(jnp.float32))
      fb[name] = (jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4))), (q, k, v, mask, bias))
    label = f"B{b} S{s // 1024}k" + (" causal" if causal else "")
    for direction, calls in (("fwd", fwd), ("fwd+bwd", fb)):
      t = time_interleaved_ms(calls, iters=10, repeats=5)
      for name, ms in t.items():
        if isinstance(ms, Exception):
          print(f"{TREE:7s} {label:15s} {direction:8s} {name:18s} ERROR {ms!r}"[:300])
          continue
        print(f"{TREE:7s} {label:15s} {direction:8s} {name:18s} {ms:8.3f} ms "
              f"{t['plain'] / ms:6.3f}x", flush=True)


main()
