"""Where segment ids cost the Mosaic forward: batched [8, 2048] documents with
all-zero ids (the walks of the call without ids) and packed rows, each arm
traced with the switches of 2026-11-27-h200-segment-compare-probe.patch set
(they are read when a call is traced). This is the last run's set of arms (run
7 in the raw output); each earlier run named its own switches in ``SW`` and
its arms in ``calls``."""
import os, sys
import jax, jax.numpy as jnp, numpy as np
import flashjax
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic.config import MosaicConfig, MosaicForward
sys.path.insert(0, ".")
from tools.launch_gaps import trace
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
H, D, N, L = 16, 128, 8, 2048
ks = jax.random.split(jax.random.key(0), 3)
qb, kb, vb = (jax.random.normal(kk, (N, L, H, D), jnp.bfloat16) for kk in ks)
qp, kp, vp = (x.reshape(1, N * L, H, D) for x in (qb, kb, vb))
zeros = jnp.zeros((N, L), jnp.int32)
docs = jnp.asarray(np.repeat(np.arange(N), L)[None].astype(np.int32))
docs32 = jnp.asarray(np.repeat(np.arange(32), 512)[None].astype(np.int32))
SW = ("PROBE_NO_COMPARE", "PROBE_ALL_MASKED")

def call(ids, args, *flags, causal=True):
  c = MosaicConfig(fwd=MosaicForward(persistent=True))
  seg = None if ids is None else (ids, ids)
  f = jax.jit(lambda q, k, v: flashjax.flash_attention(
      q, k, v, causal=causal, segment_ids=seg, platform="pallas", config=c))
  for s in SW:
    os.environ[s] = "1" if s in flags else "0"
  jax.block_until_ready(f(*args))  # traced under the switches
  for s in SW:
    os.environ[s] = "0"
  return f, args

B = (qb, kb, vb); P = (qp, kp, vp)
W, SP = "PROBE_WIDE", "PROBE_SPLIT_WHERE"
NC, AM = "PROBE_NO_COMPARE", "PROBE_ALL_MASKED"
calls = {
  "none": call(None, B),
  "zero": call(zeros, B),
  "zero+nocmp": call(zeros, B, NC),
  "zero+all_masked": call(zeros, B, AM),
  "none+all_masked": call(None, B, AM),
  "zero+nocmp+all_masked": call(zeros, B, NC, AM),
  "full/none": call(None, B, causal=False),
  "full/zero": call(zeros, B, causal=False),
  "full/zero+nocmp": call(zeros, B, NC, causal=False),
}
outs = {n: np.asarray(f(*a)).reshape(N, L, H, D) for n, (f, a) in calls.items()}
print("bit-equal:", {n: bool((o == outs["full/none" if n.startswith("full") else "none"]).all()) for n, o in outs.items()}, flush=True)
for rnd in range(2):
  t = time_interleaved_ms(calls, iters=20, repeats=7)
  for n, ms in t.items():
    print(f"  run{rnd} {n:28s} {ms:.4f} ms  none/this {t['none'] / ms:.3f}  zero/this {t['zero']/ms:.3f}", flush=True)
for n, (f, a) in calls.items():
  jax.block_until_ready(f(*a))
  _, (span, busy, idle, kernels) = trace(f, a, 20)
  top = sorted(kernels.items(), key=lambda x: -x[1])[:3]
  print(f"  {n:28s} trace: kernels {busy:.1f} us | " +
        " | ".join(f"{kn[:24]} {kt:.1f}" for kn, kt in top), flush=True)
