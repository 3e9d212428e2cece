"""Pallas GPU kernels in two subpackages: ``triton`` (Pallas lowered through Triton,
entry ``triton/pallas_triton.py``: the whole contract, forward and backward) and
``mosaic`` (Mosaic-GPU for Hopper, entry ``mosaic/mosaic.py``: a warp-specialised
forward and its own dQ and dK/dV backward kernels; an fp32 bias, or
``MosaicConfig(backward_kernel="triton")``, take the Pallas-Triton backward).
What both forwards share lives here: the split of the last wave along the keys
(``split_tail.py``, no kernel) and the kernel that merges its parts
(``tail_merge.py``).

Submodules are imported when used; the configs and ``pallas_triton`` (the
Pallas-Triton entry) are reachable from this package too, imported on first
access.
"""

import importlib

NAME = "pallas_gpu"

_LAZY = {
    "pallas_triton": (".triton.pallas_triton", None),
    "MosaicConfig": (".mosaic.config", "MosaicConfig"),
    "MosaicForward": (".mosaic.config", "MosaicForward"),
    "MosaicDq": (".mosaic.config", "MosaicDq"),
    "MosaicDkv": (".mosaic.config", "MosaicDkv"),
    "TritonConfig": (".triton.plan", "TritonConfig"),
    "TritonForward": (".triton.plan", "TritonForward"),
    "KernelConfig": (".triton.plan", "KernelConfig"),
    "DecodeConfig": (".triton.decode", "DecodeConfig"),
}


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  module, attr = _LAZY[name]
  module = importlib.import_module(module, __name__)
  return module if attr is None else getattr(module, attr)
