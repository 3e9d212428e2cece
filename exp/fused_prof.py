"""Experiment (not committed): ncu one backward (vjp) per variant at one shape."""
import dataclasses, os, sys
import jax, jax.numpy as jnp
from flashjax.benchmarks.kernel_profile import _marker, _profiler
from flashjax.common import shapes
from flashjax.benchmarks import sweeps
from flashjax.pallas_gpu import mosaic

values = sys.argv[1].split(";"); name = sys.argv[2]
start, stop = _profiler()
shp = [s for s in shapes.get("standard") if s.name == name][0]
q, k, v, do = sweeps.inputs(shp)
for val in values:
  os.environ["FJX_FUSED_EXP"] = "" if val in ("det", "-") else val
  cfg = dataclasses.replace(mosaic.MosaicConfig(), deterministic=(val == "det"))
  _, vjp = jax.vjp(lambda q, k, v: mosaic.flash_attention(q, k, v, causal=shp.causal, config=cfg), q, k, v)
  bwd = jax.jit(lambda vjp, do: vjp(do))
  jax.block_until_ready(bwd(vjp, do))
  mark = _marker("v_" + val.replace(",", "_").replace("-", "fused"))
  start(); mark(); jax.block_until_ready(bwd(vjp, do)); stop()
  os.environ.pop("FJX_FUSED_EXP")
  print("# profiled", val, flush=True)
