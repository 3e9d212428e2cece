"""Shared loop of the device-run config sweeps (mosaic_sweep, pallas_triton_sweep):
random bf16 inputs per shape, a baseline timed in the same process, one row of
TFLOP/s and ratios per shape."""

import jax
import jax.numpy as jnp

from flashjax.common import flops, shapes
from flashjax.common.mask import Band
from flashjax.common.timer import time_ms


def inputs(shp):
  """Random bf16 q, k, v and an output cotangent for one shape."""
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (shp.batch, shp.seq_q, shp.heads_q, shp.head_dim),
                        jnp.bfloat16)
  k, v = (jax.random.normal(kk, (shp.batch, shp.seq_k, shp.heads_kv, shp.head_dim),
                            jnp.bfloat16) for kk in ks[1:3])
  return q, k, v, jax.random.normal(ks[3], q.shape, jnp.bfloat16)


def forward_rows(set_name, cands, base_name, baseline, candidate, *, iters=10,
                 repeats=5):
  """Prints, per shape, the forward TFLOP/s of ``baseline(shp)`` and of
  ``candidate(text, shp, q, k, v)`` for each candidate text (each returns an
  ``f(q, k, v)``), with the ratio to the baseline. A candidate that fails (e.g.
  does not fit shared memory) is reported in its cell."""
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  for shp in shapes.get(set_name):
    q, k, v, _ = inputs(shp)
    band = Band(seq_q=shp.seq_q, seq_k=shp.seq_k, right=0 if shp.causal else None)
    fl = flops.forward_flops(batch=shp.batch, heads_q=shp.heads_q,
                             head_dim=shp.head_dim, band=band)
    base = time_ms(jax.jit(baseline(shp)), (q, k, v), iters=iters, repeats=repeats)
    row = [f"{shp.name:26s} {base_name} {fl / base / 1e9:4.0f}"]
    for text in cands:
      try:
        f = jax.jit(candidate(text, shp, q, k, v))
        t = time_ms(f, (q, k, v), iters=iters, repeats=repeats)
        row.append(f"{text} {fl / t / 1e9:4.0f} ({base / t:.2f}x)")
      except Exception as e:  # a config that does not fit is reported, not fatal
        row.append(f"{text} ERR {type(e).__name__}: {str(e)[:60]}")
    print(" | ".join(row), flush=True)
