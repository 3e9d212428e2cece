"""What one online-softmax block step costs on this CPU, per tile shape, and the
causal/non-causal time ratio the xla_cpu block schedule can reach with those costs.

  python -m tools.cpu_step_costs [--seqs 2048,4096] [--rounds 12]

A step is a stand-alone copy of the xla_cpu forward's block update (q.k^T, row
max, exp, row sum, P.V, rescale) on ``[B=1, H, rows, D] x [keys]`` tiles: the
forward's own step is a closure over its prepared operands, and the copy leaves
out its empty-row guard and its bias, cap and dropout branches. Each tile is timed
inside a ``fori_loop`` of ``steps`` steps (so dispatch is amortised), fp32, in
interleaved rounds (min and median per tile). The floor counts the steps
``xla_cpu`` runs for a causal call (full-height steps, masked or not, and the
half-height edge steps of ``Layout.split_ranges``) and weighs them by the
measured costs; fixed per-call
costs (layout transposes, loop set-up) are left out, and they only pull the ratio
towards 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flashjax.common import spec as spec_lib
from flashjax.xla_cpu import blocks
from flashjax.xla_cpu.config import XlaConfig

TILES = ((512, 256), (256, 256), (256, 512), (512, 512), (128, 256))


def step_loop(rows: int, keys: int, *, heads: int = 8, head_dim: int = 64,
              steps: int = 8, masked: bool = True):
  """``(f, args)``: ``steps`` block updates of one ``rows``-row q block over
  ``keys``-key blocks; ``masked`` applies a constant diagonal mask, as the
  causal edge steps do."""
  ks = jax.random.split(jax.random.key(rows * 7 + keys), 3)
  q = jax.random.normal(ks[0], (1, heads, 1, rows, head_dim), jnp.float32)
  kt = jax.random.normal(ks[1], (1, heads, head_dim, keys * steps), jnp.float32)
  v = jax.random.normal(ks[2], (1, heads, keys * steps, head_dim), jnp.float32)
  ok = jnp.asarray(np.arange(keys)[None, :] <= np.arange(rows)[:, None] + keys - rows)
  hi = jax.lax.Precision.HIGHEST

  def f(q, kt, v):
    def body(j, carry):
      m, l, acc = carry
      s = jnp.einsum("bhgqd,bhdk->bhgqk", q,
                     jax.lax.dynamic_slice_in_dim(kt, j * keys, keys, 3), precision=hi)
      if masked:
        s = jnp.where(ok, s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp((s - m_new[..., None]) * 0.125)
      alpha = jnp.exp((m - m_new) * 0.125)
      pv = jnp.einsum("bhgqk,bhkd->bhgqd", p,
                      jax.lax.dynamic_slice_in_dim(v, j * keys, keys, 2), precision=hi)
      return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    init = (jnp.full((1, heads, 1, rows), -jnp.inf), jnp.zeros((1, heads, 1, rows)),
            jnp.zeros((1, heads, 1, rows, head_dim)))
    return jax.lax.fori_loop(0, steps, body, init)

  return jax.jit(f), (q, kt, v)


def measure(tiles=TILES, *, rounds: int = 12, steps: int = 8, **kwargs) -> dict:
  """``{(rows, keys): (min_ms, median_ms)}`` per step, interleaved rounds."""
  calls = {t: step_loop(*t, steps=steps, **kwargs) for t in tiles}
  for f, args in calls.values():
    jax.block_until_ready(f(*args))
  samples = {t: [] for t in tiles}
  for _ in range(rounds):
    for t, (f, args) in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      samples[t].append((time.perf_counter() - t0) * 1e3 / steps)
  return {t: (min(x), statistics.median(x)) for t, x in samples.items()}


def causal_steps(seq: int, config: XlaConfig = XlaConfig()) -> tuple[int, int, int]:
  """``(full, half, total)``: full-height and half-height steps xla_cpu's forward
  runs for a causal ``seq x seq`` call, and the steps of the non-causal call."""
  x = jnp.zeros((1, seq, 1, 8), jnp.float32)
  _, spec = spec_lib.canonicalize(x, x, x, causal=True)
  lay = blocks.make_layout(spec, config, config.fwd)
  lo, t, _, _, h, hi = lay.split_ranges(over_kv=True)
  full = int(np.sum(h - t))
  half = int(np.sum(t - lo) + np.sum(hi - h)) if lay.splits_rows else 0
  return full, half, lay.num_q_blocks * lay.num_kv_blocks


def causal_floor(seq: int, cost_full: float, cost_half: float,
                 config: XlaConfig = XlaConfig()) -> float:
  """Causal / non-causal step time of the xla_cpu schedule at ``seq``."""
  full, half, total = causal_steps(seq, config)
  return (full * cost_full + half * cost_half) / (total * cost_full)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", default="2048,4096,8192")
  parser.add_argument("--rounds", type=int, default=12)
  args = parser.parse_args(argv)
  cfg = XlaConfig().fwd
  print(jax.devices()[0].device_kind, jax.__version__, "fp32, H=8, D=64", flush=True)
  costs = measure(rounds=args.rounds)
  unit = costs[(cfg.block_q, cfg.block_kv)][0]
  print("| tile (rows x keys) | ms per step, min / median | x a 512x256 step (min) "
        "| per element |")
  print("|---|---|---|---|")
  for (rows, keys), (mn, med) in costs.items():
    rel = mn / unit
    print(f"| {rows} x {keys} | {mn:.3f} / {med:.3f} | {rel:.2f} | "
          f"{rel * cfg.block_q * cfg.block_kv / (rows * keys):.2f} |")
  half = costs[(cfg.block_q // 2, cfg.block_kv)][0] / unit
  for seq in map(int, args.seqs.split(",")):
    full, n_half, total = causal_steps(seq, cfg)
    print(f"S={seq}: causal runs {full} full + {n_half} half-height steps of "
          f"{total}; causal/non-causal floor {causal_floor(seq, 1.0, half, cfg):.3f} "
          f"(half step = {half:.2f} of a full one; {causal_floor(seq, 1.0, 0.5, cfg):.3f}"
          f" if it cost half)")


if __name__ == "__main__":
  main()
