"""Device-run sweep of Pallas-Triton forward tiles on a shape set, with JAX's
Pallas-Triton example timed in the same process for ratios.

  python -m flashjax.benchmarks.pallas_triton_sweep [shape_set] [cand ...]

A candidate is ``block_q,block_kv,num_warps,num_stages`` (e.g. ``128,64,8,3``);
``-`` is the default config.
"""

import dataclasses
import sys

import jax

from flashjax.benchmarks.impls import _jax_pallas_triton
from flashjax.benchmarks.mosaic_sweep import _inputs
from flashjax.common import flops, shapes
from flashjax.common.mask import Band
from flashjax.common.spec import canonicalize
from flashjax.common.timer import time_ms
from flashjax.pallas_gpu import pallas_triton
from flashjax.pallas_gpu.triton_plan import KernelConfig

DEFAULT = ["-", "128,64,8,3", "128,64,8,4"]


def _config(text, q, k, v, causal):
  _, spec = canonicalize(q, k, v, causal=causal)
  base = pallas_triton.default_config(spec)
  if text == "-":
    return base
  bq, bk, w, s = (int(x) for x in text.split(",")[:4])
  return dataclasses.replace(base, fwd=KernelConfig(block_q=bq, block_kv=bk,
                                                    num_warps=w, num_stages=s))


def main():
  set_name = sys.argv[1] if len(sys.argv) > 1 else "standard"
  cands = sys.argv[2:] or DEFAULT
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  example = _jax_pallas_triton()
  for shp in shapes.get(set_name):
    q, k, v, _ = _inputs(shp)
    band = Band(seq_q=shp.seq_q, seq_k=shp.seq_k, right=0 if shp.causal else None)
    fl = flops.forward_flops(batch=shp.batch, heads_q=shp.heads_q,
                             head_dim=shp.head_dim, band=band)
    ref = jax.jit(lambda q, k, v: example(q, k, v, shp.causal))
    base = time_ms(ref, (q, k, v), iters=10, repeats=5)
    row = [f"{shp.name:26s} example {fl / base / 1e9:4.0f}"]
    for text in cands:
      try:
        cfg = _config(text, q, k, v, shp.causal)
        f = jax.jit(lambda q, k, v: pallas_triton.flash_attention(
            q, k, v, causal=shp.causal, config=cfg))
        t = time_ms(f, (q, k, v), iters=10, repeats=5)
        row.append(f"{text} {fl / t / 1e9:4.0f} ({base / t:.2f}x)")
      except Exception as e:  # a config that does not fit is reported, not fatal
        row.append(f"{text} ERR {type(e).__name__}: {str(e)[:60]}")
    print(" | ".join(row), flush=True)


if __name__ == "__main__":
  main()
