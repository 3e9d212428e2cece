"""Platform registry and automatic choice.

A platform registers only if its module imports; each follows the protocol of
``common/platform.py`` (``supported(spec) -> None | reason``, ``CONFIG``,
``attention_from_operands(ops, spec, config)``, ...), and its reasons and errors
name no platform: the frontend adds the name. The frontend walks an ordered list
per backend, moves on after a reason or a ``NotImplementedError`` (logged once),
and reports every reason if all fail. An explicitly named platform that cannot run
raises with its reason.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

from .common import hardware

log = logging.getLogger("flashjax")


@dataclasses.dataclass(frozen=True)
class Platform:
  name: str
  module: str  # under this package
  backends: tuple[str, ...]


PLATFORMS = {p.name: p for p in [
    Platform("xla", "xla_cpu", ("cpu", "gpu", "tpu")),
    Platform("pallas-tpu", "pallas_tpu", ("tpu",)),
    Platform("pallas-mosaic-gpu", "pallas_gpu.mosaic.mosaic", ("gpu",)),
    Platform("pallas-triton", "pallas_gpu.triton.pallas_triton", ("gpu",)),
    Platform("triton", "triton_gpu", ("gpu",)),
]}

# Seed names: "jax" (jax-flash-attn2) is the XLA platform; "pallas" means the
# Pallas kernel family of the backend.
ALIASES = {"jax": "xla", "xla": "xla", "triton": "triton",
           "pallas-triton": "pallas-triton"}


def resolve(platform: str, backend: str) -> str:
  if platform == "pallas":
    return "pallas-tpu" if backend == "tpu" else "pallas-mosaic-gpu"
  name = ALIASES.get(platform, platform)
  if name not in PLATFORMS:
    raise ValueError(f"platform must be one of {sorted(set(ALIASES) | {'pallas'})}"
                     f", got {platform!r}")
  return name


def preferred_order(backend: str) -> list[str]:
  if backend == "cpu":
    return ["xla"]
  if backend == "tpu":
    return ["pallas-tpu", "xla"]
  if backend in ("gpu", "cuda", "rocm"):
    head = ["pallas-mosaic-gpu", "triton", "pallas-triton"] if hardware.is_hopper() else [
        "triton", "pallas-triton"]
    return head + ["xla"]
  return ["xla"]


def load(name: str):
  """The platform's module, or raises ``NotImplementedError`` with why not."""
  p = PLATFORMS[name]
  try:
    # Relative to this package, so that a copy imported under another name
    # (two trees side by side in one process) dispatches to its own kernels.
    return importlib.import_module(f".{p.module}", __package__)
  except ImportError as e:
    raise NotImplementedError(f"{name}: does not import here ({e})") from e


def reason_unsupported(name: str, spec, backend: str) -> str | None:
  p = PLATFORMS[name]
  if backend not in p.backends and not (backend in ("cuda", "rocm") and
                                        "gpu" in p.backends):
    return f"{name}: not for backend {backend!r} (runs on {', '.join(p.backends)})"
  try:
    mod = load(name)
  except NotImplementedError as e:
    return str(e)
  reason = mod.supported(spec)
  return f"{name}: {reason}" if reason else None


_logged: set = set()


def log_once(msg: str):
  if msg not in _logged:
    _logged.add(msg)
    log.warning(msg)
