"""Wall-clock timing of jitted calls, shared by the benchmark CLI and autotuning."""

from __future__ import annotations

import statistics
import time

import jax


def time_ms(f, args, *, iters: int, repeats: int) -> float:
  """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, in
  ms; the first call (compilation, warm-up) is excluded."""
  jax.block_until_ready(f(*args))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) * 1e3 / iters)
  return statistics.median(samples)
