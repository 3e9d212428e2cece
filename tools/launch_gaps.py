"""Where a call's wall time goes on the GPU: kernels vs the gaps between them.

  python -m tools.launch_gaps IMPLS SHAPES [N] [SET]

IMPLS are benchmark names (``pallas,jax-cudnn``); SHAPES are name prefixes in the
shape set SET (default ``standard``; ``B2-S8k`` takes its causal and non-causal
rows). In the ``packed`` sets each implementation runs as the CLI's packed
benchmark runs it (with segment ids, ``[batched]`` on the same documents, and
the varlen entries; benchmarks/packed.py), which splits a packed call's cost
into its kernels and the XLA work that prepares the ids (the ids and offsets
are arguments of the traced programs). Each forward and each backward (the vjp
alone) runs N times back to back under ``jax.profiler``; from the trace's
device events it prints, per call, the host wall time, the span from the first
kernel's start to the last one's end, the kernels' busy time (the union of
their intervals) and the idle time inside the span, and the kernels by total
time. A CLI ratio that differs from the kernels' ratio (Nsight Compute) shows
up here as idle device time or as host time outside the span.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time


def events_by_device(trace_dir: str):
  """``{device name: [(name, ts_us, dur_us)]}`` of the GPU streams' complete
  events in the trace under ``trace_dir``, each list in time order."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                          recursive=True))[-1]
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  out = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and "GPU" in names.get(e.get("pid"), ""):
      out[names[e["pid"]]].append((e["name"], e["ts"], e.get("dur", 0)))
  return {k: sorted(v, key=lambda e: e[1]) for k, v in out.items()}


def device_events(trace_dir: str):
  """``[(name, ts_us, dur_us)]`` of every GPU's streams, in time order."""
  return sorted((e for events in events_by_device(trace_dir).values()
                 for e in events), key=lambda e: e[1])


def union(intervals):
  """Sorted disjoint ``[(start, end)]`` covering ``intervals``."""
  merged = []
  for s, e in sorted(intervals):
    if merged and s <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], e)
    else:
      merged.append([s, e])
  return [tuple(x) for x in merged]


def length(intervals) -> float:
  return sum(e - s for s, e in intervals)


def summarize(events, n: int):
  """Span, busy and idle time per call (us) and per-kernel totals per call."""
  if not events:
    return None
  start = min(ts for _, ts, _ in events)
  end = max(ts + dur for _, ts, dur in events)
  # Busy time as the union of intervals (streams may overlap).
  busy = length(union((ts, ts + dur) for _, ts, dur in events))
  kernels = collections.defaultdict(float)
  for name, _, dur in events:
    kernels[name] += dur / n
  span = (end - start) / n
  return span, busy / n, span - busy / n, kernels


def trace(f, args, n: int):
  """``n`` back-to-back calls of ``f`` (compiled and warm) under
  ``jax.profiler``: wall time per call (us) and :func:`summarize` of the
  device events."""
  import jax
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      t0 = time.perf_counter()
      for _ in range(n):
        out = f(*args)
      jax.block_until_ready(out)
      wall = (time.perf_counter() - t0) * 1e6 / n
    return wall, summarize(device_events(d), n)


def measure(fn, args, n: int):
  """:func:`trace` of ``fn`` jitted, after two warm-up calls."""
  import jax
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  return trace(f, args, n)


def main(argv):
  import jax
  import jax.numpy as jnp
  from flashjax.benchmarks import impls, packed, timing
  from flashjax.common import shapes as shape_sets
  names, prefixes = argv[0].split(","), argv[1].split(",")
  n = int(argv[2]) if len(argv) > 2 else 20
  set_name = argv[3] if len(argv) > 3 else "standard"
  shapes = [s for s in shape_sets.get(set_name)
            if any(s.name.startswith(p) for p in prefixes)]
  built = {}
  for name in names:
    fn, reason = impls.build(name)
    if fn is None:
      print(f"{name}: not run: {reason}")
    else:
      built[name] = fn
  if set_name.startswith("packed"):
    calls = packed.variants(built)
  else:
    calls = {name: (lambda s, fn=fn: fn) for name, fn in built.items()}
  for s in shapes:
    q, k, v, do = timing.random_inputs(s, jnp.bfloat16)
    for name, build in calls.items():
      fn = build(s)
      ops = packed.operands(fn)
      fwd = lambda q, k, v, *ops, fn=fn, s=s: fn(q, k, v, s.causal, *ops)
      # The vjp function is a pytree: its residuals (a packed call's ids among
      # them) are arguments of the jitted backward, not constants XLA could fold.
      _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, *ops), q, k, v)
      for direction, call, args in (("fwd", fwd, (q, k, v, *ops)),
                                    ("bwd", lambda vjp, do: vjp(do), (vjp, do))):
        wall, summary = measure(call, args, n)
        if summary is None:
          print(f"{s.name:26s} {name:10s} {direction} wall {wall:8.1f} us; no device events")
          continue
        span, busy, idle, kernels = summary
        print(f"{s.name:26s} {name:10s} {direction} wall {wall:8.1f} us  span {span:8.1f}"
              f"  kernels {busy:8.1f}  idle {idle:6.1f}")
        for kname, t in sorted(kernels.items(), key=lambda x: -x[1])[:12]:
          print(f"      {t:8.1f} us  {kname[:90]}")
      sys.stdout.flush()


if __name__ == "__main__":
  main(sys.argv[1:])
