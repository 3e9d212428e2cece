"""The split tail's merge: one small Pallas-Triton kernel that combines the key-range
parts of each tail block (split_tail.py) as the online softmax would, writing the
block's output and lse in place. Both the Pallas-Triton forward (triton/fwd.py)
and the Mosaic-GPU persistent forward (mosaic/fwd.py) launch it; the Mosaic parts
store the normalised output (as a high and a low half in the input dtype) and
``m`` = lse in log2 units, with no ``l``: the same weights merge them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..common.blocking import LN2
from .split_tail import Tail


def _combine_kernel(*refs, tail: Tail, rows: int, n_acc: int, has_l: bool):
  accs, (m_ref, *rest) = refs[:n_acc], refs[n_acc:]
  l_ref = rest.pop(0) if has_l else None
  _, _, out_ref, lse_ref = rest  # the first two are aliased to these
  u = pl.program_id(0)
  sl = pl.ds(pl.program_id(1) * rows, rows)
  ms = [m_ref[u, j, sl] for j in range(tail.parts)]
  top = functools.reduce(jnp.maximum, ms)
  top_safe = jnp.where(top == -jnp.inf, 0.0, top)
  ws = [jnp.exp2(m - top_safe) for m in ms]
  # Normalised parts (no l): each weighs 1, or 0 through its m = -inf.
  l_sum = sum(w * (l_ref[u, j, sl] if has_l else 1.0) for j, w in enumerate(ws))
  part = lambda j: sum(a[u, j, sl, :].astype(jnp.float32) for a in accs)
  acc = sum(w[:, None] * part(j) for j, w in enumerate(ws))
  ok = (top > -jnp.inf) & (l_sum > 0)
  l_safe = jnp.where(ok, l_sum, 1.0)
  out_ref[...] = (acc / l_safe[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(ok, (top_safe + jnp.log2(l_safe)) * LN2, -jnp.inf)


# Rows per merge program: a tail block's rows are spread over several programs so
# that the merge's reads are not limited by one program per tail block (H200,
# 2026-11-23: 17 us for 68 blocks of 5 parts with one 4-warp program per block).
COMBINE_ROWS = 32


def combine(out, lse, partials, tail: Tail, coords, block_q: int, interpret: bool):
  """Writes the tail blocks of ``out [B, Sqp, H, Dv]`` and ``lse [B, H, Sqp]`` in
  place from ``partials = (acc [T, k, bq, Dv], m [T, k, bq], l [T, k, bq])``: acc
  and l are summed with base-2 weights relative to the parts' common row max (``m``
  is in log2 units). ``acc`` may be a tuple of arrays whose fp32 sum is the part's
  accumulator (e.g. a high and a low half), and ``l`` None for parts whose acc is
  already normalised (``m`` then being the part's lse in log2 units).
  ``coords(program) -> (q block, batch, head)``."""
  accs, m, l = partials
  accs = tuple(accs) if isinstance(accs, (tuple, list)) else (accs,)
  partials = accs + (m,) + (() if l is None else (l,))
  rows = min(COMBINE_ROWS, block_q)
  chunks = block_q // rows
  assert chunks * rows == block_q, (block_q, rows)

  def out_index(u, r):
    i, b, h = coords(tail.full + u)
    return b, i * chunks + r, h, 0

  def lse_index(u, r):
    i, b, h = coords(tail.full + u)
    return b, h, i * chunks + r

  # The tail block's output and lse rows, read (aliased) and written by one spec.
  blocks = [pl.BlockSpec((None, rows, None, out.shape[3]), out_index),
            pl.BlockSpec((None, None, rows), lse_index)]
  return pl.pallas_call(
      functools.partial(_combine_kernel, tail=tail, rows=rows, n_acc=len(accs),
                        has_l=l is not None),
      grid=(tail.count, chunks),
      in_specs=[pl.BlockSpec(x.shape, lambda u, r, n=x.ndim: (0,) * n)
                for x in partials] + blocks,
      out_specs=blocks,
      out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype),
                 jax.ShapeDtypeStruct(lse.shape, lse.dtype)],
      input_output_aliases={len(partials): 0, len(partials) + 1: 1},
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="flashjax_pallas_triton_fwd_tail",
  )(*partials, out, lse)
