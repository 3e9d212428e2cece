"""Experiment (not committed): fwd+bwd of the Mosaic backward variants, cuDNN
interleaved in the same rounds. Values: 'det' = two-kernel backward; anything
else = single-pass backward with FJX_FUSED_EXP set to it ('-' for none)."""
import dataclasses, os, sys
import jax, jax.numpy as jnp
from flashjax.benchmarks import sweeps
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic

values = sys.argv[1].split(";"); sets = sys.argv[2]
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
print(jax.devices()[0].device_kind, jax.__version__, values, flush=True)
for shp in shapes.get(sets):
  if only and not any(shp.name.startswith(o) for o in only):
    continue
  q, k, v, do = sweeps.inputs(shp)
  def grad_of(attn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), (0, 1, 2)))
  cud = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=shp.causal, implementation="cudnn")
  calls = {"cudnn": (grad_of(cud), (q, k, v))}
  ref = jax.block_until_ready(calls["cudnn"][0](q, k, v))
  errs = []
  for val in values:
    os.environ["FJX_FUSED_EXP"] = "" if val in ("det", "-") else val
    cfg = dataclasses.replace(mosaic.MosaicConfig(), deterministic=(val == "det"))
    att = lambda q, k, v, cfg=cfg: mosaic.flash_attention(q, k, v, causal=shp.causal, config=cfg)
    fn = grad_of(att)
    g = jax.block_until_ready(fn(q, k, v))
    err = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) for a, b in zip(g, ref))
    errs.append(f"{val}:{err:.3g}")
    calls[val] = (fn, (q, k, v))
    os.environ.pop("FJX_FUSED_EXP")
  t = time_interleaved_ms(calls, iters=10, repeats=repeats)
  print(f"{shp.name:26s} max|dx-cudnn| " + " ".join(errs), flush=True)
  print(f"{shp.name:26s} fwd+bwd ms " + " | ".join(f"{n} {x:6.3f} ({t['cudnn'] / x:.3f})" for n, x in t.items()), flush=True)
