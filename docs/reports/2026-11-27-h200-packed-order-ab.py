"""Packed Mosaic forward, causal: one CTA per tile ("tile", the default), the
balanced persistent launch with its order computed by window ranks ("bal", now)
or by an argsort ("bal-sort", before), and the same documents batched. Single
calls (fwd, fwd+bwd) and a chain of four calls (a model's layers, per call).
Interleaved rounds; outputs compared bitwise."""
import sys
import jax, jax.numpy as jnp, numpy as np
import flashjax
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import blocks
from flashjax.pallas_gpu.mosaic.config import MosaicConfig, MosaicForward
sys.path.insert(0, ".")
from tools.launch_gaps import trace

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
H, D = 16, 128
window_order = blocks._window_order


def sort_order(steps, size, most):
  n = steps.shape[0]
  t = jnp.arange(n, dtype=jnp.int32)
  return jnp.argsort((t // size) * (most + 1) + (most - steps), stable=True)


def build(fn, args, sort=False):
  blocks._window_order = sort_order if sort else window_order
  try:
    return jax.jit(fn).lower(*args).compile()
  finally:
    blocks._window_order = window_order


for docs, causal in (((2048,) * 8, True), ((512,) * 32, True), (shapes.MIXED_16K, True),
                     ((2048,) * 8, False)):
  s, n = sum(docs), len(docs)
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (1, s, H, D), jnp.bfloat16) for kk in ks)
  ids = jnp.asarray(np.repeat(np.arange(n), docs)[None].astype(np.int32))
  arms = {"tile": (False, False), "bal": (True, False), "bal-sort": (True, True)}
  if not causal:
    arms = {"bal": (None, False), "bal-sort": (None, True)}
  fwd, step, chain, outs = {}, {}, {}, {}
  for name, (persistent, sort) in arms.items():
    c = MosaicConfig(fwd=MosaicForward(persistent=persistent))
    attn = lambda q, k, v, c=c: flashjax.flash_attention(
        q, k, v, causal=causal, segment_ids=(ids, ids), platform="pallas", config=c)
    loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v).astype(jnp.float32) *
                                              do.astype(jnp.float32))
    fwd[name] = (build(attn, (q, k, v), sort), (q, k, v))
    step[name] = (build(jax.grad(loss, (0, 1, 2)), (q, k, v), sort), (q, k, v))
    chain[name] = (build(lambda q, k, v, attn=attn: attn(attn(attn(attn(q, k, v), k, v),
                                                             k, v), k, v),
                         (q, k, v), sort), (q, k, v))
    outs[name] = fwd[name][0](q, k, v)
  if len(set(docs)) == 1:
    qb, kb, vb, dob = (x.reshape(n, docs[0], H, D) for x in (q, k, v, do))
    attn_b = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal,
                                                      platform="pallas")
    fwd["batched"] = (jax.jit(attn_b), (qb, kb, vb))
    step["batched"] = (jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        attn_b(q, k, v).astype(jnp.float32) * dob.astype(jnp.float32)), (0, 1, 2))),
        (qb, kb, vb))
  first = next(iter(outs.values()))
  same = all(bool(jnp.array_equal(first, o)) for o in outs.values())
  label = f"{n} docs{' causal' if causal else ''}"
  print(f"{label}: outputs bit-equal across arms {same}", flush=True)
  for what, calls, per in (("fwd", fwd, 1), ("fwd+bwd", step, 1), ("4-call chain, per call", chain, 4)):
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    base = t["tile" if causal else "bal-sort"]
    print(f"  {label} {what}: " + " | ".join(
        f"{m} {ms / per:.4f} ms ({base / ms:.3f})" for m, ms in t.items()), flush=True)
  for name in ("bal", "bal-sort"):
    f, a = fwd[name]
    jax.block_until_ready(f(*a))
    _, (span, busy, idle, kernels) = trace(f, a, 20)
    top = sorted(kernels.items(), key=lambda x: -x[1])[:4]
    print(f"  {label} {name} trace: kernels {busy:.1f} us idle {idle:.1f} | " +
          " | ".join(f"{kn[:28]} {kt:.1f}" for kn, kt in top), flush=True)
