"""``python -m flashjax.info``: backend, devices, versions, and which platform can
run which feature on this machine."""

from __future__ import annotations

import importlib
import sys

import jax

from . import api, registry
from .common.spec import FEATURES, abstract_spec

_FEATURE_ARGS = {
    "causal": dict(causal=True), "window": dict(sliding_window=(64, 0)),
    "segment_ids": dict(segment_ids=(jax.ShapeDtypeStruct((1, 256), "int32"),
                                     jax.ShapeDtypeStruct((1, 256), "int32"))),
    "bias": dict(bias=jax.ShapeDtypeStruct((256, 256), "float32")),
    "mask": dict(mask=jax.ShapeDtypeStruct((256, 256), "bool")),
    "soft_cap": dict(logits_soft_cap=30.0),
    "sinks": dict(sinks=jax.ShapeDtypeStruct((4,), "float32")),
    "dropout": dict(dropout_rate=0.1), "lse": dict(return_lse=True),
}


def _version(module: str) -> str:
  try:
    return getattr(importlib.import_module(module), "__version__", "?")
  except Exception as e:
    return f"not available ({type(e).__name__})"


def capability_matrix(backend: str) -> list[list[str]]:
  rows = []
  for name in registry.PLATFORMS:
    cells = [name]
    for feature in ("base",) + FEATURES + ("float32", "float16"):
      kwargs = _FEATURE_ARGS.get(feature, {})
      dtype = feature if feature in ("float32", "float16") else "bfloat16"
      spec = abstract_spec(batch=1, seq_q=256, seq_k=256, heads_q=4, head_dim=128,
                           dtype=dtype, **kwargs)
      cells.append("no" if registry.reason_unsupported(name, spec, backend) else "yes")
    rows.append(cells)
  return rows


def main() -> int:
  backend = api.detect_backend(None, None)
  print(f"flashjax {importlib.import_module('flashjax').__version__}, python "
        f"{sys.version.split()[0]}")
  for mod in ("jax", "jaxlib", "triton", "jax_triton"):
    print(f"  {mod}: {_version(mod)}")
  print(f"backend: {backend}; devices: {jax.devices()}")
  print(f"preferred order here: {', '.join(registry.preferred_order(backend))}")
  head = ["platform", "base"] + list(FEATURES) + ["fp32", "fp16"]
  print("\n| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for row in capability_matrix(backend):
    print("| " + " | ".join(row) + " |")
  spec = abstract_spec(batch=1, seq_q=256, seq_k=256, heads_q=4, head_dim=128)
  print("\nwhy not (bf16, no features):")
  for name in registry.PLATFORMS:
    print(f"  {registry.reason_unsupported(name, spec, backend) or name + ': runs'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
