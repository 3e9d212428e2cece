"""Tuning configuration of the xla_cpu platform."""

from __future__ import annotations

import dataclasses

import jax

from ..common import platform


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """One online-softmax loop's blocks: ``block_q`` query rows (clipped to Sq) and
  ``block_kv`` keys (clipped to Sk)."""

  block_q: int = 512
  block_kv: int = 256

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaConfig:
  """Blocks of the forward and backward loops.

  Attributes:
    fwd: the forward's blocks (and the KV-cache decode's ``block_kv``).
    bwd: the backward's blocks.
    compute_dtype: dtype of the block matmuls; None picks fp32 (fp64 for fp64
      inputs) on CPU and the input dtype with fp32 accumulation elsewhere.
  """

  fwd: BlockSizes = BlockSizes()
  bwd: BlockSizes = BlockSizes()
  compute_dtype: str | None = None

  def __post_init__(self):
    for name in ("fwd", "bwd"):
      if type(getattr(self, name)) is not BlockSizes:
        raise ValueError(f"{name} must be an xla_cpu BlockSizes, got "
                         f"{getattr(self, name)!r}")
    if self.compute_dtype not in (None, "float32", "float64", "bfloat16", "float16"):
      raise ValueError(f"compute_dtype must be None or a float dtype name, got "
                       f"{self.compute_dtype!r}")


def default_config(spec, backend: str | None = None) -> XlaConfig:
  """Heuristic per backend.

  On CPU, 512 x 256 blocks were fastest of {256, 512} x {256, 512} and 128 x 1024
  (2-core x86 CI machine, fp32, H=8, D=64, S=2048/4096: docs/BENCHMARKS.md);
  smaller blocks would skip more of a causal problem but each step runs its
  matmuls less efficiently.
  """
  backend = backend or jax.default_backend()
  if backend == "cpu":
    return XlaConfig()
  # Accelerators: larger blocks amortise loop overhead; matmuls stay in the input
  # dtype with fp32 accumulation.
  blocks = BlockSizes(block_q=512, block_kv=1024)
  return XlaConfig(fwd=blocks, bwd=blocks,
                   compute_dtype=None if spec.dtype in ("float32", "float64")
                   else spec.dtype)


# jax-flash-attn2's ``blocksize_q``/``blocksize_k`` over the default config (one
# pair for both loops).
config_from_block_sizes = platform.block_sizes(default_config, ("fwd", "bwd"))
