"""Experiment (not committed): A/B of an env switch read at trace time, Mosaic
forward (and optionally fwd+bwd), cuDNN interleaved in the same rounds."""
import os, sys
import jax, jax.numpy as jnp
from flashjax.benchmarks import sweeps
from flashjax.common import flops, shapes
from flashjax.common.mask import Band
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic

var = sys.argv[1]; values = sys.argv[2].split(";"); sets = sys.argv[3]
dirs = sys.argv[4].split(",") if len(sys.argv) > 4 else ["fwd"]
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 5
print(jax.devices()[0].device_kind, jax.__version__, var, values, flush=True)
for shp in shapes.get(sets):
  q, k, v, do = sweeps.inputs(shp)
  band = Band(seq_q=shp.seq_q, seq_k=shp.seq_k, right=0 if shp.causal else None)
  ff = flops.forward_flops(batch=shp.batch, heads_q=shp.heads_q, head_dim=shp.head_dim, band=band)
  def grad_of(attn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), (0, 1, 2)))
  cud = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=shp.causal, implementation="cudnn")
  calls = {d: {"cudnn": ((jax.jit(cud) if d == "fwd" else grad_of(cud)), (q, k, v))} for d in dirs}
  ref = None
  for val in values:
    os.environ[var] = val
    att = lambda q, k, v: mosaic.flash_attention(q, k, v, causal=shp.causal)
    fns = {"fwd": jax.jit(att), "bwd": grad_of(att)}
    outs = {d: jax.block_until_ready(fns[d](q, k, v)) for d in dirs}
    o_ref = jax.block_until_ready(jax.jit(cud)(q, k, v))
    err = float(jnp.abs(jax.jit(att)(q, k, v).astype(jnp.float32) - o_ref.astype(jnp.float32)).max())
    if ref is None:
      ref = outs
      print(f"  {val}: max |out - cudnn| {err:.3g}", flush=True)
    else:
      same = all(bool(jnp.array_equal(a, b)) for d in dirs for a, b in zip(jax.tree.leaves(outs[d]), jax.tree.leaves(ref[d])))
      print(f"  {val}: max |out - cudnn| {err:.3g}; bit-identical to {values[0]}: {same}", flush=True)
    for d in dirs:
      calls[d][val] = (fns[d], (q, k, v))
    del os.environ[var]
  row = f"{shp.name:26s}"
  for d in dirs:
    t = time_interleaved_ms(calls[d], iters=10, repeats=repeats)
    if d == "fwd":
      row += " fwd TF/s " + " | ".join(f"{n} {ff / x / 1e9:4.0f} ({t['cudnn'] / x:.3f})" for n, x in t.items())
    else:
      row += "  fwd+bwd ms " + " | ".join(f"{n} {x:6.3f} ({t['cudnn'] / x:.3f})" for n, x in t.items())
  print(row, flush=True)
