"""The math every platform does around its kernels, in XLA: sinks, the backward's
row term ``delta``, and the reductions of dbias and dsinks.

Sinks only enlarge the softmax denominator, so kernels compute attention without
them and ``add_sinks`` rescales: ``out *= exp(lse_rows - lse_total)``. In the
backward a sink has no value, so ``dsink = -sum_rows p_sink * delta``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _acc(x):
  return jnp.promote_types(x.dtype, jnp.float32)


def add_sinks(out, lse, sinks):
  """``out [B, Sq, Hq, Dv]`` (any float), ``lse [B, Hq, Sq]`` of the rows alone,
  ``sinks [Hq, n]`` -> output and lse with the sinks in the denominator (fp32)."""
  acc = _acc(out)
  lse_sinks = jax.scipy.special.logsumexp(sinks.astype(acc), axis=-1)
  total = jnp.logaddexp(lse, lse_sinks[None, :, None])
  scale = jnp.where(jnp.isfinite(lse), jnp.exp(lse - total), 0.0)
  return out.astype(acc) * jnp.swapaxes(scale, 1, 2)[..., None], total


def delta(out, do, dlse):
  """``rowsum(do * o) - dlse`` as ``[B, Hq, Sq]`` (fp32, fp64 for fp64)."""
  acc = _acc(out)
  # Reduce over the contiguous head dim in the inputs' [B, Sq, Hq] order and
  # transpose the small result apart: XLA GPU fuses the transposed reduction
  # (and the kernels' stats concatenation) into one kernel that took 275-290 us
  # at B8 S2k / B2 S8k H16 D128, against 44-55 us this way and 68 us for cuDNN's
  # own (H200, 2026-11-22, docs/BENCHMARKS.md).
  rows = jax.lax.optimization_barrier(
      jnp.sum(do.astype(acc) * out.astype(acc), axis=-1))
  return jnp.swapaxes(rows, 1, 2) - dlse.astype(acc)


def safe_lse(lse):
  """+inf on rows with nothing to attend, so ``exp(s - lse)`` is exactly 0 there."""
  return jnp.where(jnp.isfinite(lse), lse, jnp.inf)


def finish_forward(out, lse, spec, sinks):
  """A kernel's padded ``out [B, Sqp, Hq, >=Dv]`` and ``lse [B, Hq, Sqp]`` cut to the
  call's sizes, with the sinks (if any) added to the denominator."""
  out = out[:, :spec.seq_q, :, :spec.head_dim_v]
  lse = lse[:, :, :spec.seq_q]
  if spec.num_sinks:
    sunk, lse = add_sinks(out, lse, sinks)
    out = sunk.astype(out.dtype)
  return out, lse


def backward_rows(out, do, dlse, lse, seq_q_padded: int):
  """Per-row terms of a backward kernel: ``delta [B, Hq, Sq]`` (for dsinks) and the
  kernels' ``lse`` and ``delta`` padded to ``seq_q_padded`` rows. Padded and empty
  rows get lse = +inf, so ``exp(s - lse)`` is exactly 0 there, and delta = 0."""
  row_delta = delta(out, do, dlse)
  pad = ((0, 0), (0, 0), (0, seq_q_padded - lse.shape[-1]))
  lse_rows = jnp.pad(safe_lse(lse), pad, constant_values=jnp.inf)
  return row_delta, lse_rows, jnp.pad(row_delta, pad)


def dbias_from_ds(ds, spec, bias):
  """dbias from a kernel's padded ``ds [B|1, Hq, Sqp, Skp]`` (fp32, or bf16;
  one row where the kernel summed the batch): cut to the call's sizes and
  summed in fp32 over the dims ``bias`` broadcasts."""
  ds = ds[:, :, :spec.seq_q, :spec.seq_k]
  ds = reduce_to_shape(ds.astype(jnp.promote_types(ds.dtype, jnp.float32)), bias.shape)
  return ds.reshape(bias.shape).astype(bias.dtype)


def sinks_grad(sinks, lse, row_delta):
  """dsinks ``[Hq, n]`` from the total lse and delta, both ``[B, Hq, Sq]``."""
  p_sink = jnp.exp(sinks.astype(_acc(lse))[None, :, None, :] - safe_lse(lse)[..., None])
  return -jnp.sum(p_sink * row_delta[..., None], (0, 2)).astype(sinks.dtype)


def reduce_to_shape(x, shape):
  """Sums ``x`` over the axes where ``shape`` broadcasts (size 1), keeping rank."""
  axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n > 1)
  return x.sum(axes, keepdims=True) if axes else x
