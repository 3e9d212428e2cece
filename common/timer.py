"""Wall-clock timing of jitted calls, shared by the benchmark CLI and autotuning."""

from __future__ import annotations

import statistics
import time

import jax


def time_ms(f, args, *, iters: int, repeats: int) -> float:
  """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, in
  ms; the first call (compilation, warm-up) is excluded."""
  jax.block_until_ready(f(*args))
  return statistics.median(_sample_ms(f, args, iters) for _ in range(repeats))


def _sample_ms(f, args, iters: int) -> float:
  """Mean time of ``iters`` back-to-back calls, in ms."""
  t0 = time.perf_counter()
  for _ in range(iters):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) * 1e3 / iters


def time_interleaved_ms(calls: dict, *, iters: int, repeats: int,
                        settle_ms: float = 100.0) -> dict:
  """``{name: ms}`` for ``calls = {name: (f, args)}``, sampled in rounds: each
  round times ``iters`` back-to-back calls of every entry once, starting one entry
  later than the round before, and each entry's median over the rounds is
  returned. Before each sample the entry runs untimed for ``settle_ms`` (at least
  one call), so the sample sees the device in the steady state of its own load
  and not in the one the previous entry left: on an H200 a 50 ms sample taken
  right after another kernel's sustained load read 3% off either way. The
  rounds spread slower drift (clocks, temperature) over every entry alike. An
  entry that raises is reported as its exception instead of a time."""
  names = list(calls)
  out, samples = {}, {n: [] for n in names}
  for n in names:  # warm-up, compilation
    f, args = calls[n]
    try:
      jax.block_until_ready(f(*args))
    except Exception as e:  # noqa: BLE001 - reported per entry
      out[n] = e
  live = [n for n in names if n not in out]
  for r in range(repeats):
    for n in live[r % len(live):] + live[:r % len(live)] if live else []:
      f, args = calls[n]
      t0 = time.perf_counter()
      while True:
        jax.block_until_ready(f(*args))
        if (time.perf_counter() - t0) * 1e3 >= settle_ms:
          break
      samples[n].append(_sample_ms(f, args, iters))
  out.update({n: statistics.median(samples[n]) for n in live})
  return out
