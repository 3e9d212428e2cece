"""dbias from a dQ kernel's per-row dS, reading only the tiles a band reaches:
one small Pallas-Triton kernel.

Where dS is summed over the batch or heads outside the kernel, the Mosaic dQ
kernel leaves dS's tiles outside the band unwritten
(``Geometry.ds_reached_only``). A sum in XLA would still read them, selecting
zeros in its read: under a causal band half of dS's bytes, read for nothing
(forward+backward 1.04-1.07x slower at B2 S8k and B4 S4k causal, 1.14x under a
2048-key window, H200, 2026-11-28). Here each program owns one output tile: it
sums that tile of dS over the batch rows and heads the bias broadcasts over
(fp32), or writes zeros where the band reaches none of it, without reading dS
there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(reach_ref, ds_ref, out_ref, *, tile, heads_out, summed, sum_b, sum_h,
            heads_in):
  o, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  ob, oh = o // heads_out, o % heads_out
  rows, cols = pl.ds(i * tile[0], tile[0]), pl.ds(j * tile[1], tile[1])
  reached = reach_ref[i, j] != 0

  @pl.when(reached)
  def _sum():
    def add(t, acc):
      # t walks the summed (batch, head) pairs, heads fastest.
      b = (t // heads_in if sum_h else t) if sum_b else ob
      h = (t % heads_in if sum_b else t) if sum_h else oh
      return acc + ds_ref[b, h, rows, cols].astype(jnp.float32)
    acc = lax.fori_loop(0, summed, add, jnp.zeros(tile, jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)

  @pl.when(jnp.logical_not(reached))
  def _zeros():
    out_ref[...] = jnp.zeros(tile, out_ref.dtype)


def band_sum(ds, reached: np.ndarray, out_rows: int, out_heads: int, dtype,
             interpret: bool = False):
  """``ds [B, H, Sqp, Skp]`` summed in fp32 to ``[out_rows, out_heads, Sqp,
  Skp]`` in ``dtype``. ``out_rows`` is ``B`` or 1 (summed over the batch),
  ``out_heads`` ``H`` or 1 (over the heads). ``reached [nq, nk]`` (bool, on
  the host) splits dS into ``Sqp / nq`` by ``Skp / nk`` tiles: only those
  marked are read, the others come out zero whatever ``ds`` holds there."""
  batch, heads, sqp, skp = ds.shape
  nq, nk = reached.shape
  tile = (sqp // nq, skp // nk)
  if tile[0] * nq != sqp or tile[1] * nk != skp:
    raise ValueError(f"reached {reached.shape} does not tile ds {ds.shape}")
  if out_rows not in (1, batch) or out_heads not in (1, heads):
    raise ValueError(f"out_rows {out_rows} / out_heads {out_heads} must be 1 or "
                     f"ds's {batch} / {heads}")
  sum_b, sum_h = out_rows < batch, out_heads < heads
  summed = (batch if sum_b else 1) * (heads if sum_h else 1)
  reach = jnp.asarray(np.asarray(reached, np.int32))
  full = lambda x: pl.BlockSpec(x.shape, lambda o, i, j, n=x.ndim: (0,) * n)
  return pl.pallas_call(
      functools.partial(_kernel, tile=tile, heads_out=out_heads, summed=summed,
                        sum_b=sum_b, sum_h=sum_h, heads_in=heads),
      grid=(out_rows * out_heads, nq, nk),
      in_specs=[full(reach), full(ds)],
      out_specs=pl.BlockSpec((None, None) + tile,
                             lambda o, i, j: (o // out_heads, o % out_heads, i, j)),
      out_shape=jax.ShapeDtypeStruct((out_rows, out_heads, sqp, skp), dtype),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="flashjax_dbias_band_sum",
  )(reach, ds)
