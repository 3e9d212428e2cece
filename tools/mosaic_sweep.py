"""Device-run sweep of Mosaic-GPU configs on a shape set, with cuDNN timed in the
same process for ratios.

  python -m tools.mosaic_sweep [shape_set] [name=value,... ...]
  python -m tools.mosaic_sweep --bwd [shape_set] [name=value,... ...]

Each candidate is a set of MosaicConfig fields, a kernel's as ``kernel.field``,
e.g. ``fwd.block_kv=64,fwd.num_stages=3`` or ``fwd.persistent=0`` (``-`` is the
default config). The forward sweep times the forward; ``--bwd`` times
``jax.grad`` (forward + backward), e.g. with ``dq.block_kv=128,dkv.block_q=128``
or ``bwd_one_launch=0`` or ``bwd_single_pass=1``.
"""

import sys

import jax
import jax.numpy as jnp

from tools import sweeps
from flashjax.common import shapes
from flashjax.common.timer import time_ms
from flashjax.pallas_gpu import mosaic
from flashjax.pallas_gpu.mosaic import config as mosaic_config

DEFAULT = ["-", "fwd.persistent=0", "fwd.persistent=1",
           "fwd.block_kv=64,fwd.num_stages=3"]


def config(text) -> mosaic.MosaicConfig:
  """The MosaicConfig of a candidate string (``-``: the default)."""
  fields = {}
  for item in ([] if text == "-" else text.split(",")):
    name, value = item.split("=")
    kernel, _, field = name.rpartition(".")
    if field in ("persistent", "bwd_one_launch", "bwd_single_pass", "split_tail",
                 "balanced"):
      value = bool(int(value))
    elif field != "backward_kernel":
      value = int(value)
    (fields.setdefault(kernel, {}) if kernel else fields)[field] = value
  return mosaic_config.from_json(fields)


def sweep_backward(set_name, cands):
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  for shp in shapes.get(set_name):
    q, k, v, do = sweeps.inputs(shp)

    def grad_of(attn):
      return jax.jit(jax.grad(lambda q, k, v: jnp.sum(
          attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), (0, 1, 2)))

    base = time_ms(grad_of(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=shp.causal, implementation="cudnn")), (q, k, v),
        iters=10, repeats=5)
    row = [f"{shp.name:26s} cudnn fwd+bwd {base:6.3f} ms"]
    for text in cands:
      try:
        cfg = config(text)
        t = time_ms(grad_of(lambda q, k, v: mosaic.flash_attention(
            q, k, v, causal=shp.causal, config=cfg)), (q, k, v), iters=10, repeats=5)
        row.append(f"{text} {t:6.3f} ({base / t:.2f}x)")
      except Exception as e:  # a config that does not fit is reported, not fatal
        row.append(f"{text} ERR {type(e).__name__}: {str(e)[:60]}")
    print(" | ".join(row), flush=True)


def main():
  if sys.argv[1:2] == ["--bwd"]:
    args = sys.argv[2:]
    return sweep_backward(args[0] if args else "standard", args[1:] or ["-"])
  set_name = sys.argv[1] if len(sys.argv) > 1 else "standard"
  sweeps.forward_rows(
      set_name, sys.argv[2:] or DEFAULT, "cudnn",
      lambda shp: lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=shp.causal, implementation="cudnn"),
      lambda text, shp, q, k, v: lambda q, k, v: mosaic.flash_attention(
          q, k, v, causal=shp.causal, config=config(text)))


if __name__ == "__main__":
  main()
