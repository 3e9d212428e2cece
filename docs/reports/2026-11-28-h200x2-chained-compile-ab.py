"""Compile and run time of chained attention calls, one process per case.

  python docs/reports/2026-11-28-h200x2-chained-compile-ab.py LABEL KIND LAYERS

LABEL names the tree in the output (each tree runs in its own process with
its own ``flashjax`` on the path: trees under two names in one process mix
their modules); KIND: "ring" (the zigzag causal ring over every GPU, 8k tokens per GPU,
B1 H16 D128 bf16) or "plain" (one GPU, causal B2 S8k H16 D128); LAYERS calls
chained in one jitted forward+backward (each output the next call's q, as a
model's layers). Prints the trace, lowering and compile times, the lowered
text's size and the time per call (median of 5 samples of 5 steps).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import flashjax as fj

label, kind, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])

if kind == "ring":
  n = len(jax.devices())
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  shape = (1, 8192 * n, 16, 128)

  def attend(q, k, v):
    f = lambda q, k, v: fj.ring_attention(q, k, v, axis_name="seq", layout="zigzag",
                                          causal=True)
    return jax.shard_map(f, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                         out_specs=P(None, "seq"), check_vma=False)(q, k, v)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
else:
  shape = (2, 8192, 16, 128)
  attend = lambda q, k, v: fj.flash_attention(q, k, v, causal=True)
  put = lambda x: x


def chain(q, k, v):
  for _ in range(layers):
    q = attend(q, k, v)
  return q


def loss(q, k, v, do):
  return jnp.sum(chain(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))


keys = jax.random.split(jax.random.key(0), 4)
args = [put(jax.random.normal(kk, shape, jnp.bfloat16)) for kk in keys]
fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
t0 = time.perf_counter()
traced = fn.trace(*args)
t1 = time.perf_counter()
lowered = traced.lower()
t2 = time.perf_counter()
compiled = lowered.compile()
t3 = time.perf_counter()
text = len(lowered.as_text())
jax.block_until_ready(compiled(*args))
samples = []
for _ in range(5):
  t = time.perf_counter()
  for _ in range(5):
    out = compiled(*args)
  jax.block_until_ready(out)
  samples.append((time.perf_counter() - t) / 5 / layers * 1e3)
print(f"{label:8s} {kind:5s} layers {layers}  trace {t1 - t0:6.2f} s  lower {t2 - t1:6.2f} s  "
      f"compile {t3 - t2:6.2f} s  text {text / 1e6:6.2f} MB  fwd+bwd per call "
      f"{np.median(samples):8.3f} ms", flush=True)
