"""What segment ids cost the Mosaic forward where they mask nothing: documents
batched [8, 2048] causal without ids and with all-zero ids (the same walks),
each with the balanced launch (default) and one CTA per tile; and the same
documents packed into one row. Full calls in interleaved rounds; GPU time per
kernel from a profiler trace."""
import sys
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


def call(ids, persistent):
  c = MosaicConfig(fwd=MosaicForward(persistent=persistent))
  seg = None if ids is None else (ids, ids)
  return jax.jit(lambda q, k, v: flashjax.flash_attention(
      q, k, v, causal=True, segment_ids=seg, platform="pallas", config=c))


calls = {
    "batched/bal": (call(None, True), (qb, kb, vb)),
    "batched+zero-ids/bal": (call(zeros, True), (qb, kb, vb)),
    "batched/tile": (call(None, False), (qb, kb, vb)),
    "batched+zero-ids/tile": (call(zeros, False), (qb, kb, vb)),
    "packed/bal": (call(docs, True), (qp, kp, vp)),
}
outs = {n: np.asarray(f(*a)).reshape(N, L, H, D) for n, (f, a) in calls.items()}
ref = outs["batched/bal"]
print("bit-equal to batched/bal:", {n: bool((o == ref).all()) for n, o in outs.items()},
      flush=True)
t = time_interleaved_ms(calls, iters=20, repeats=7)
for n, ms in t.items():
  print(f"  {n:24s} {ms:.4f} ms  batched/bal over this {t['batched/bal'] / ms:.3f}",
        flush=True)
for n, (f, a) in calls.items():
  jax.block_until_ready(f(*a))
  _, (span, busy, idle, kernels) = trace(f, a, 20)
  top = sorted(kernels.items(), key=lambda x: -x[1])[:3]
  print(f"  {n:24s} trace: kernels {busy:.1f} us | " +
        " | ".join(f"{kn[:24]} {kt:.1f}" for kn, kt in top), flush=True)
