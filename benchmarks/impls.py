"""The implementations the benchmark runs side by side.

Each entry builds ``fn(q, k, v, causal) -> out`` on ``[B, S, H, D]`` inputs, or
raises with the reason it cannot run here; the CLI lists such entries with that
reason instead of failing. Peers are imported only when asked for.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Impl:
  name: str
  kind: str  # "flashjax" or "peer"
  build: Callable[[], Callable]  # -> fn(q, k, v, causal)
  backends: tuple[str, ...] = ("cpu", "gpu", "tpu")
  # Run without --impls: a variant of another entry's config runs when named.
  by_default: bool = True


def _flashjax_platform(module: str, **extra):
  def build():
    import importlib
    from flashjax.common.spec import abstract_spec
    mod = importlib.import_module(f"flashjax.{module}")
    probe = abstract_spec(batch=1, seq_q=256, seq_k=256, heads_q=2, head_dim=128,
                          dtype="bfloat16")
    reason = mod.supported(probe)
    if reason:
      raise NotImplementedError(reason)
    # Keyword arguments (segment_ids for packed shapes) go to the platform.
    return lambda q, k, v, causal, **kw: mod.flash_attention(q, k, v, causal=causal,
                                                             **extra, **kw)
  return build


def _mosaic_backward(single_pass: bool):
  """The Mosaic platform with ``MosaicConfig.bwd_single_pass`` set on top of
  each call's default config (the default takes the single pass only where it
  was measured faster), so both backward designs time side by side."""
  def build():
    from flashjax.common import spec as spec_lib
    from flashjax.pallas_gpu.mosaic import mosaic

    def fn(q, k, v, causal, **kw):
      spec = spec_lib.canonicalize(q, k, v, causal=causal, **kw)[1]
      config = dataclasses.replace(mosaic.default_config(spec),
                                   bwd_single_pass=single_pass)
      return mosaic.flash_attention(q, k, v, causal=causal, config=config, **kw)
    return fn
  return build


def _jax_nn(implementation):
  def build():
    return lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=implementation)
  return build


def _jax_pallas_triton():
  from jax.experimental.pallas.ops.gpu import attention
  # The example's default blocks (128 x 128); it takes BSHD inputs.
  return lambda q, k, v, causal: attention.mha(
      q, k, v, segment_ids=None, causal=causal, sm_scale=q.shape[-1] ** -0.5)


def _fa3():
  import flash_attn3_jax
  return lambda q, k, v, causal: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal)


def _stub_xprof():
  """tokamax imports xprof for its own benchmarking only."""
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(name, types.ModuleType(name))
  sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None


def _tokamax(implementation):
  def build():
    _stub_xprof()
    import tokamax
    return lambda q, k, v, causal: tokamax.dot_product_attention(
        q, k, v, is_causal=causal, implementation=implementation)
  return build


def _lucidrains():
  from flash_attention_jax import causal_flash_attention, flash_attention
  import jax.numpy as jnp

  def fn(q, k, v, causal):
    # BHSD layout; its non-causal entry takes a key mask.
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    if causal:
      out = causal_flash_attention(q, k, v)
    else:
      mask = jnp.ones((q.shape[0], k.shape[2]), bool)
      out = flash_attention(q, k, v, mask)
    return jnp.swapaxes(out, 1, 2)
  return fn


IMPLS: dict[str, Impl] = {i.name: i for i in [
    Impl("xla", "flashjax", _flashjax_platform("xla_cpu")),
    Impl("pallas", "flashjax", _flashjax_platform("pallas_gpu.mosaic.mosaic"), ("gpu",)),
    Impl("pallas-single-pass", "flashjax", _mosaic_backward(True), ("gpu",), False),
    Impl("pallas-two-kernels", "flashjax", _mosaic_backward(False), ("gpu",), False),
    Impl("pallas-triton", "flashjax", _flashjax_platform("pallas_gpu.triton.pallas_triton"),
         ("gpu",)),
    Impl("triton", "flashjax", _flashjax_platform("triton_gpu"), ("gpu",)),
    Impl("jax-xla", "peer", _jax_nn("xla")),
    Impl("jax-cudnn", "peer", _jax_nn("cudnn"), ("gpu",)),
    Impl("jax-pallas-triton", "peer", _jax_pallas_triton, ("gpu",)),
    Impl("flash-attn3-jax", "peer", _fa3, ("gpu",)),
    Impl("tokamax-mosaic", "peer", _tokamax("mosaic"), ("gpu",)),
    Impl("tokamax-triton", "peer", _tokamax("triton"), ("gpu",)),
    Impl("lucidrains", "peer", _lucidrains),
]}


def default_names(backend: str) -> list[str]:
  return [n for n, i in IMPLS.items() if backend in i.backends and i.by_default]


def build(name: str):
  """``(fn, None)`` or ``(None, reason)``."""
  impl = IMPLS.get(name)
  if impl is None:
    return None, f"unknown implementation; known: {sorted(IMPLS)}"
  backend = jax.default_backend()
  if backend not in impl.backends:
    return None, f"not for backend {backend}"
  try:
    return impl.build(), None
  except Exception as e:  # a peer that does not import is reported, not fatal
    return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
