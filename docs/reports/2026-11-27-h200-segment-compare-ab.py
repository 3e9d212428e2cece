"""Mosaic kernels under segment ids: every masked step compares ids ("before",
the tree importable as ``flashjax_prev``) or only the masked steps outside the
warpgroup's own-id run do, the band's masked steps inside it skip the compare
("now", blocks.band_walk). Packed causal and full rows, and batched documents
with all-zero ids (the walks of the call without ids). Forward, and forward +
backward, full calls in interleaved rounds; results compared bitwise."""
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
H, D = 16, 128
CASES = [("8x2048 causal", (2048,) * 8, True, False),
         ("32x512 causal", (512,) * 32, True, False),
         ("mixed causal", shapes.MIXED_16K, True, False),
         ("8x2048 full", (2048,) * 8, False, False),
         ("batched [8,2048] zero ids causal", (2048,) * 8, True, True)]


def operands(docs, batched):
  ks = jax.random.split(jax.random.key(0), 4)
  shape = (len(docs), docs[0], H, D) if batched else (1, sum(docs), H, D)
  q, k, v, w = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks)
  if batched:
    ids = jnp.zeros(shape[:2], jnp.int32)
  else:
    ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None].astype(np.int32))
  return (q, k, v), w, ids


for label, docs, causal, batched in CASES:
  args, w, ids = operands(docs, batched)
  call = lambda m: (lambda q, k, v: m.flash_attention(
      q, k, v, causal=causal, segment_ids=(ids, ids), return_lse=True))
  fwd = {n: (jax.jit(call(m)), args) for n, m in (("before", old), ("now", new))}
  loss = lambda m: (lambda q, k, v: jnp.sum(
      call(m)(q, k, v)[0].astype(jnp.float32) * w.astype(jnp.float32)))
  grad = {n: (jax.jit(jax.grad(loss(m), argnums=(0, 1, 2))), args)
          for n, m in (("before", old), ("now", new))}
  same = {}
  for kind, calls in (("fwd", fwd), ("fwd+bwd", grad)):
    a, b = (jax.block_until_ready(f(*x)) for f, x in calls.values())
    same[kind] = all(bool(jnp.array_equal(x, y)) for x, y in
                     zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  for kind, calls in (("fwd", fwd), ("fwd+bwd", grad)):
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    print(f"{label:34s} {kind:8s} ms before {t['before']:.4f} | now {t['now']:.4f} | "
          f"before/now {t['before'] / t['now']:.3f} | bit-equal {same[kind]}", flush=True)
