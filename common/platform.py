"""The platform protocol: what every platform module declares and exposes.

A platform module (``xla_cpu``, ``pallas_tpu``, ``pallas_gpu.mosaic.mosaic``,
``pallas_gpu.triton.pallas_triton``, ``triton_gpu``) defines

* ``NAME``: its registry name (``"xla"``, ``"pallas-tpu"``, ...);
* ``CAPABILITIES``: a :class:`Capabilities`, declared once: dtypes, head dims and
  contract features it runs. Its ``supported(spec)`` starts from
  ``CAPABILITIES.unsupported(spec)``, and the conformance suite's flags come from
  it (``conformance.Capabilities.of``);
* ``CONFIG``: its config type (a frozen dataclass); a config of another type is a
  ``ValueError`` (:func:`check_config`);
* ``supported(spec) -> None | reason``, ``default_config(spec)``,
  ``config_from_block_sizes(spec, block_q, block_kv)`` (:func:`block_sizes`) and
  ``attention_from_operands(ops, spec, config=None[, interpret=False])``;
* ``flash_attention``, the contract on arrays, made by :func:`entry`.

Reasons and errors name no platform: the registry and :func:`entry` add it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from . import spec as spec_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
  """What a platform runs; everything else raises ``NotImplementedError``.

  Attributes:
    dtypes: input dtypes.
    max_head_dim: the largest of ``head_dim`` and ``head_dim_v``; None: any.
    features: contract features (``spec.FEATURES``) the kernels implement.
    interpret: the kernels have an interpret mode (``interpret=True`` on CPU).
  """

  dtypes: tuple[str, ...]
  max_head_dim: int | None = None
  features: frozenset[str] = frozenset(spec_lib.FEATURES)
  interpret: bool = False

  def __post_init__(self):
    unknown = set(self.features) - set(spec_lib.FEATURES)
    if unknown:
      raise ValueError(f"features must be among {spec_lib.FEATURES}, got "
                       f"{sorted(unknown)}")

  def head_dim_ok(self, d: int) -> bool:
    return self.max_head_dim is None or d <= self.max_head_dim

  def unsupported(self, spec: spec_lib.AttentionSpec) -> str | None:
    """Why ``spec`` is outside these capabilities, or None."""
    if spec.dtype not in self.dtypes:
      return f"dtype {spec.dtype} (supported: {', '.join(self.dtypes)})"
    d = max(spec.head_dim, spec.head_dim_v)
    if not self.head_dim_ok(d):
      return f"head dim {d} > {self.max_head_dim}"
    used = sorted(spec.features - self.features)
    if used:
      return f"features {', '.join(used)} not in this kernel"
    return None


@dataclasses.dataclass(frozen=True)
class Static:
  """The static half of a kernel platform's call (hashable: ``custom_vjp``'s
  static argument): its resolved config and whether it runs interpreted."""

  config: Any
  interpret: bool = False


def check_config(config, config_type: type, name: str):
  """``config``, or ``ValueError`` unless it is exactly a ``config_type`` (a
  subclass belongs to another platform: the Pallas-Triton config extends the
  triton one)."""
  if type(config) is not config_type:
    raise ValueError(f"config must be a {config_type.__name__} (platform {name!r}), "
                     f"got {type(config).__name__}")
  return config


def block_sizes(default_config, parts: tuple[str, ...]):
  """A platform's ``config_from_block_sizes(spec, block_q=None, block_kv=None)``:
  jax-flash-attn2's ``blocksize_q``/``blocksize_k`` over ``default_config(spec)``,
  set in the per-kernel configs named by ``parts`` (``("fwd",)``, ``("fwd",
  "bwd")``)."""

  def config_from_block_sizes(spec, block_q=None, block_kv=None):
    return with_block_sizes(default_config(spec), block_q, block_kv, parts)

  return config_from_block_sizes


def with_block_sizes(config, block_q, block_kv, parts: tuple[str, ...]):
  """``config`` with ``block_q``/``block_kv`` (where not None) set in ``parts``."""
  def one(c):
    return dataclasses.replace(c, block_q=block_q or c.block_q,
                               block_kv=block_kv or c.block_kv)
  for part in parts:
    config = dataclasses.replace(config, **{part: one(getattr(config, part))})
  return config


def entry(name: str, attention_from_operands, capabilities: Capabilities):
  """The platform's ``flash_attention(q, k, v, *, config=None, **contract)``:
  validates the contract's arguments (``spec.canonicalize``) and runs
  ``attention_from_operands``; a ``NotImplementedError`` names the platform."""

  def flash_attention(q, k, v, *, config=None, interpret: bool = False, **kwargs):
    ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
    if interpret and not capabilities.interpret:
      raise ValueError(f"interpret=True: platform {name!r} has no interpret mode")
    extra = {"interpret": bool(interpret)} if capabilities.interpret else {}
    try:
      out, lse = attention_from_operands(ops, spec, config, **extra)
    except NotImplementedError as e:
      if type(e) is not NotImplementedError:  # e.g. vjp.SecondOrderError
        raise
      raise NotImplementedError(f"{name}: {e}") from e
    return (out, lse) if spec.return_lse else out

  flash_attention.__doc__ = (
      f"Exact attention on the {name} platform; the contract of docs/DESIGN.md.\n\n"
      "  Args: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``;\n"
      "  ``config``: the platform's config (default: its heuristic, or the autotune\n"
      "  cache); " + ("``interpret``: run the kernels in Pallas' interpreter;\n  "
                      if capabilities.interpret else "") +
      "the contract's keywords (bias, mask, causal, sliding_window, segment_ids,\n"
      "  softmax_scale, logits_soft_cap, sinks, dropout_rate, dropout_seed,\n"
      "  return_lse).\n\n"
      "  Returns: ``out [B, Sq, Hq, Dv]`` in q's dtype, or ``(out, lse [B, Hq, Sq])``.")
  flash_attention.__qualname__ = "flash_attention"
  return flash_attention


@functools.lru_cache(maxsize=256)
def traced_once(fn, static_argnums=(1, 2), static_argnames=()):
  """``fn`` under ``jax.jit`` with the named arguments static (by default a
  platform function's ``spec`` and ``static``: ``fn(ops, spec, static, ...)``),
  so that a program lowers each distinct kernel call once, however often it
  makes it: a model's layers, a ring's hops, chained ring calls, a decode
  step's layers. ``fn`` should be a module-level function (one jitted function
  per ``fn``). Called inline, every call lowered its kernels anew: on two H200s
  (2026-11-28) sixteen chained Mosaic-GPU calls (forward+backward) took 86.8 s
  to trace, lower and compile against 8.8 s under ``jit``, and four chained
  zigzag rings 59.1 s against 15.4 s. XLA inlines the calls when it compiles,
  so the same kernels run (times per call within 0.5%). An eager call is one
  cached program instead of op-by-op dispatch: the xla platform's causal B1
  S256 H4 D64 forward took 1.7 against 540 ms per call on the 2-core CPU VM."""
  return jax.jit(fn, static_argnums=static_argnums, static_argnames=static_argnames)
