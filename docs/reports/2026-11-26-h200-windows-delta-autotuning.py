"""In-place against sliced windows (D = 256, causal) in one process: do dq and
the backward's row term delta = rowsum(dO * out), an XLA reduction, differ?

  python3 docs/reports/2026-11-26-h200-windows-delta-autotuning.py pallas_gpu/tests/mosaic_test.py
"""
import importlib.util
import os
import sys

import jax, numpy as np
spec_ = importlib.util.spec_from_file_location("mt", sys.argv[1])
mt = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(mt)
from flashjax.common import rows, epilogue
from flashjax.pallas_gpu.mosaic import mosaic
ops, spec, static, do, dlse = mt._windows(256, True, 256)

def full(o, d):
  out, lse = mosaic.forward(o, spec, static)
  g = mosaic.backward(o, spec, static, out, lse, d, dlse)
  delta = epilogue.delta(rows.materialize(out), rows.materialize(d), dlse)
  return out, lse, g.q, g.k, g.v, delta

f = jax.jit(full)
a = [np.asarray(x, np.float32) for x in f(ops, do)]
b = [np.asarray(x, np.float32) for x in f(*rows.materialize((ops, do)))]
print(os.environ.get("XLA_FLAGS", ""), {n: int((x != y).sum()) for n, x, y in
      zip(("out", "lse", "dq", "dk", "dv", "delta"), a, b)}, flush=True)
