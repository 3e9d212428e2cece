"""What the kernels need to know of the machine, detected in one place.

GPU generation (compute capability, shared memory per block, Hopper), SM count and
TPU generation. Every function takes an optional ``device`` (a JAX device, or any
object with its attributes) and otherwise asks the first device of the kind, looked
up once per process. Without a GPU (or a TPU) the answers are the "no GPU" ones:
``compute_capability() is None``, ``is_hopper() is False``, ``tpu_generation() is
None``; ``gpu_target()`` and ``num_sms()`` then give Hopper's values, which is what
lowering and interpret mode on CPU size their tiles for.
"""

from __future__ import annotations

import dataclasses
import functools

import jax


@functools.cache
def _first_device(platform: str):
  try:
    return jax.devices(platform)[0]
  except RuntimeError:  # no such backend here
    return None


def gpu_device(device=None):
  """``device`` if it is a GPU, the first GPU when ``device`` is None, else None."""
  device = _first_device("gpu") if device is None else device
  return device if getattr(device, "platform", None) in ("gpu", "cuda", "rocm") else None


def gpu_count() -> int:
  """GPUs of this process (0 without a GPU backend): multi-GPU runs need 2 or more."""
  return len(jax.devices("gpu")) if _first_device("gpu") is not None else 0


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU generation: ``shared_memory`` is what one block may use; ``hopper``:
  the tiles measured on Hopper (long-key tiles, split tails) apply."""

  name: str
  shared_memory: int
  hopper: bool = False


HOPPER = GpuTarget("hopper/blackwell-datacenter", 227 * 1024, hopper=True)
# Per-block shared memory by CUDA compute capability (CUDA programming guide), and
# AMD's 64 KiB LDS. Only Hopper's tiles are measured; the others are sized to fit.
BY_CAPABILITY = {
    (7, 0): GpuTarget("volta", 96 * 1024),
    (7, 5): GpuTarget("turing", 64 * 1024),
    (8, 0): GpuTarget("ampere-datacenter", 163 * 1024),
    (8, 6): GpuTarget("ampere", 99 * 1024),
    (8, 7): GpuTarget("ampere-orin", 163 * 1024),
    (8, 9): GpuTarget("ada", 99 * 1024),
    (9, 0): HOPPER,
    (10, 0): GpuTarget("blackwell-datacenter", 227 * 1024),
    (12, 0): GpuTarget("blackwell", 99 * 1024),
}
AMD = GpuTarget("amd", 64 * 1024)


def is_amd(device=None) -> bool:
  dev = gpu_device(device)
  if dev is None:
    return False
  cc = str(getattr(dev, "compute_capability", "") or "")
  kind = getattr(dev, "device_kind", "")
  return cc.startswith("gfx") or any(t in kind for t in ("AMD", "Instinct", "Radeon"))


def compute_capability(device=None) -> tuple[int, int] | None:
  """``(major, minor)`` of an NVIDIA GPU; None without one (or on AMD)."""
  dev = gpu_device(device)
  if dev is None or is_amd(dev):
    return None
  try:
    major, minor = (int(x) for x in str(dev.compute_capability).split(".")[:2])
  except (AttributeError, ValueError):
    return None
  return major, minor


def gpu_target(device=None) -> GpuTarget:
  """The GPU's generation; Hopper where there is no GPU (lowering and interpret
  mode on CPU) or the generation is unknown."""
  if gpu_device(device) is None:
    return HOPPER
  if is_amd(device):
    return AMD
  cc = compute_capability(device)
  if cc is None:
    return HOPPER
  exact = BY_CAPABILITY.get(cc)
  if exact is not None:
    return exact
  same_major = [t for (ma, _), t in sorted(BY_CAPABILITY.items()) if ma == cc[0]]
  return same_major[0] if same_major else HOPPER


def is_hopper(device=None) -> bool:
  """A GPU of compute capability 9.x (H100, H200, H800, H20, GH200): the wgmma
  and TMA instructions of the Mosaic-GPU kernels."""
  cc = compute_capability(device)
  return cc is not None and cc[0] == 9


def num_sms(device=None) -> int:
  """Multiprocessors of the GPU (H100/H200 SXM: 132; also the value used when
  lowering on a machine without a GPU)."""
  dev = gpu_device(device)
  return (getattr(dev, "core_count", None) if dev is not None else None) or 132


TPU_GENERATIONS = ("v6e", "v5p", "v5e", "v4")


def tpu_generation(device=None) -> str | None:
  """One of ``TPU_GENERATIONS``, or None without a TPU or for another one."""
  dev = _first_device("tpu") if device is None else device
  if getattr(dev, "platform", None) != "tpu":
    return None
  kind = dev.device_kind.lower()
  for gen in ("v6e", "v6 lite", "v5p", "v5e", "v5 lite", "v4"):
    if gen in kind:
      return {"v5 lite": "v5e", "v6 lite": "v6e"}.get(gen, gen)
  return None
