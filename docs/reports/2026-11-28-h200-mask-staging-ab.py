"""Whether 128-key forward blocks beside a mask's float8 tile pay once the
output keeps its own staging buffer: run as ``python3 <this> BUDGET`` with
BUDGET the forward's shared-memory budget in bytes (``default`` keeps
fwd.SMEM_BUDGET; 230400 makes room for the buffer beside Q, the K/V ring and
the tile, 229,888 bytes). Times the forward, in interleaved rounds per shape:
the plain call, the masked call with 64-key and with 128-key blocks.

Ran at the tree of 2026-11-28 before fwd.SMEM_BUDGET gave way to
fwd.smem_bytes (main before 4214e78); later trees ignore the budget."""

import sys

import jax
import jax.numpy as jnp

from flashjax import flash_attention
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import config as mcfg, fwd as mfwd

if sys.argv[1] != "default":
  mfwd.SMEM_BUDGET = int(sys.argv[1])
SHAPES = [(8, 2048, True), (2, 8192, True), (8, 2048, False)]
H, D = 16, 128


def main():
  for b, s, causal in SHAPES:
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(x, (b, s, H, D), jnp.float32).astype(jnp.bfloat16)
               for x in keys[:3])
    mask = jax.random.bernoulli(keys[4], 0.9, (b, 1, s, s))
    cfg = lambda bk: mcfg.MosaicConfig(fwd=mcfg.MosaicForward(block_kv=bk, num_stages=2))
    calls = {
        "plain": (jax.jit(lambda q, k, v, m: flash_attention(
            q, k, v, causal=causal, platform="pallas")), (q, k, v, mask)),
    }
    for bk in (64, 128):
      calls[f"mask {bk}-key"] = (jax.jit(lambda q, k, v, m, bk=bk: flash_attention(
          q, k, v, mask=m, causal=causal, platform="pallas", config=cfg(bk))),
          (q, k, v, mask))
    t = time_interleaved_ms(calls, iters=10, repeats=5)
    label = f"B{b} S{s // 1024}k" + (" causal" if causal else "")
    for name, ms in t.items():
      if isinstance(ms, Exception):
        print(f"{sys.argv[1]:8s} {label:15s} {name:14s} ERROR {ms!r}"[:400], flush=True)
        continue
      print(f"{sys.argv[1]:8s} {label:15s} {name:14s} {ms:8.3f} ms "
            f"{t['plain'] / ms:6.3f}x", flush=True)


main()
