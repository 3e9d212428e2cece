"""Device-run smoke check of the Mosaic-GPU platform: relative error of out and lse
against the fp32 reference on a spread of shapes and features, and of dq/dk/dv
on most of them (the Mosaic dK/dV kernel up to D = 128, Pallas-Triton's at 256). Prints one line per case; exits non-zero on any failure.

  python -m flashjax.benchmarks.mosaic_check
"""

import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from flashjax.common import reference
from flashjax.pallas_gpu import mosaic

CASE_TIMEOUT_S = 90
CASES = [
    dict(S=512, D=128), dict(S=512, D=128, causal=True), dict(S=1024, D=64, causal=True),
    dict(S=512, D=256), dict(S=300, Sk=700, D=96, sliding_window=(100, 20)),
    dict(S=700, Sk=300, D=128, causal=True), dict(S=256, D=128, H=4, Hkv=1,
                                                  logits_soft_cap=20.0),
    dict(S=384, D=128, sinks=True, causal=True), dict(S=2048, D=128, causal=True, B=2),
    dict(S=200, D=64, sliding_window=(0, 0)),
]

GRAD_CASES = (1, 2, 3, 4, 5, 6, 7, 9)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  fin = np.isfinite(b)
  if not np.array_equal(np.isfinite(a), fin):
    return float("inf")
  return float(np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), 1e-30))


def run(case, grad=False):
  c = dict(case)
  b, s = c.pop("B", 1), c.pop("S")
  sk, d, h = c.pop("Sk", s), c.pop("D"), c.pop("H", 2)
  hkv = c.pop("Hkv", h)
  keys = jax.random.split(jax.random.key(s + d), 5)
  q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, sk, hkv, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, sk, hkv, d), jnp.bfloat16)
  if c.pop("sinks", False):
    c["sinks"] = jax.random.normal(keys[3], (h, 1), jnp.float32)
  f = jax.jit(lambda q, k, v: mosaic.flash_attention(q, k, v, return_lse=True, **c))
  out, lse = f(q, k, v)
  up = lambda x: x.astype(jnp.float32)
  r_out, r_lse = reference.attention(up(q), up(k), up(v), return_lse=True, **{
      n: x for n, x in c.items()})
  errs = [rel(out, r_out), rel(lse, r_lse)]
  if grad:
    do = jax.random.normal(keys[4], out.shape, jnp.bfloat16)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(up(mosaic.flash_attention(
        q, k, v, **c)) * up(do)), argnums=(0, 1, 2)))(q, k, v)
    rg = jax.grad(lambda q, k, v: jnp.sum(reference.attention(q, k, v, **c) * up(do)),
                  argnums=(0, 1, 2))(up(q), up(k), up(v))
    errs += [rel(x, y) for x, y in zip(g, rg)]
  return errs


def one(i):
  t = time.time()
  case = CASES[i]
  errs = run(case, grad=i in GRAD_CASES)
  ok = all(e < 2e-2 for e in errs)
  print(f"{'ok ' if ok else 'BAD'} {case} rel errs {['%.1e' % e for e in errs]} "
        f"({time.time() - t:.1f}s)", flush=True)
  sys.exit(0 if ok else 1)


def main():
  if len(sys.argv) > 2 and sys.argv[1] == "--case":
    return one(int(sys.argv[2]))
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  bad = 0
  # One process per case: a hang or crash costs that case only.
  for i, case in enumerate(CASES):
    try:
      res = subprocess.run([sys.executable, "-m", "flashjax.benchmarks.mosaic_check",
                            "--case", str(i)], capture_output=True, text=True,
                           timeout=CASE_TIMEOUT_S)
      print(res.stdout.strip() or f"BAD {case}: " + res.stderr[-1500:], flush=True)
      bad += res.returncode != 0
    except subprocess.TimeoutExpired:
      print(f"BAD {case}: no result in {CASE_TIMEOUT_S} s (hang or slow compile)",
            flush=True)
      bad += 1
  print(f"{len(CASES) - bad} passed, {bad} failed")
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
