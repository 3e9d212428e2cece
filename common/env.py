"""Environment variables read as numbers, with errors that name the variable."""

from __future__ import annotations

import os


def positive_int(name: str) -> int | None:
  """The positive int in environment variable ``name``; None when it is unset or
  empty. Anything else raises ``ValueError`` naming the variable and its value."""
  raw = os.environ.get(name, "").strip()
  if not raw:
    return None
  try:
    value = int(raw)
  except ValueError:
    value = 0
  if value < 1:
    raise ValueError(f"environment variable {name} must be a positive int, got "
                     f"{os.environ[name]!r}")
  return value


def with_xla_flags(*flags: str) -> str:
  """``XLA_FLAGS`` of this process with ``flags`` appended: the value to give a
  subprocess, so that it keeps the flags its parent runs under."""
  return " ".join([os.environ.get("XLA_FLAGS", "").strip(), *flags]).strip()


def cpu_devices_env(n: int) -> dict:
  """The environment of a subprocess that runs JAX on ``n`` fake CPU devices,
  with this process's other variables and XLA flags."""
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=with_xla_flags(f"--xla_force_host_platform_device_count={n}"))
