"""Per-kernel profile of forward and backward calls, for Nsight Compute.

Run under ``ncu --profile-from-start off --csv --page details ...``::

  python -m tools.kernel_profile run IMPLS SHAPES [--causal 0,1]

SHAPES are name prefixes in the ``standard`` set (``B2-S8k`` takes its causal
and non-causal rows). Each (implementation, shape) is compiled and warmed up
outside the profiled range; inside it one forward and one backward (the vjp
alone; forward only for FORWARD_ONLY) run, each after an empty marker kernel
named ``mark_<impl>_<shape>_<fwd|bwd>``, so the report can be split per call.
``summarize CSV`` turns ncu's CSV into one table row per kernel: duration, the
sections' headline numbers and the tensor-pipe metrics that were collected.
"""

from __future__ import annotations

import collections
import csv
import re
import sys

_MARK = re.compile(r"mark_(\w+?)_(fwd|bwd)\b")
# The Triton-based rows are there for the forward against JAX's example; their
# backwards are 3x the example's and would only lengthen the profile.
FORWARD_ONLY = ("pallas-triton", "jax-pallas-triton", "triton")


def _profiler():
  """cudaProfilerStart/Stop through CuPy (the device image has it)."""
  import cupy
  return cupy.cuda.runtime.profilerStart, cupy.cuda.runtime.profilerStop


def _marker(tag: str):
  import cupy
  name = "mark_" + re.sub(r"\W", "_", tag)
  kern = cupy.RawKernel(f'extern "C" __global__ void {name}() {{}}', name)

  def launch():
    kern((1,), (1,), ())
    cupy.cuda.runtime.deviceSynchronize()
  launch()  # compile before the profiled range
  return launch


def run(impl_names, shape_names, causal_flags):
  import jax
  import jax.numpy as jnp
  from flashjax.benchmarks import impls
  from flashjax.common import shapes

  start, stop = _profiler()
  for shp in [s for s in shapes.get("standard")
              if any(s.name.startswith(w) for w in shape_names)]:
    if shp.causal not in causal_flags:
      continue
    ks = jax.random.split(jax.random.key(0), 4)
    mk = lambda key, h: jax.random.normal(
        key, (shp.batch, shp.seq_q, h, shp.head_dim), jnp.float32).astype(jnp.bfloat16)
    q, k, v, do = mk(ks[0], shp.heads_q), mk(ks[1], shp.heads_kv), mk(
        ks[2], shp.heads_kv), mk(ks[3], shp.heads_q)
    for name in impl_names:
      fn, reason = impls.build(name)
      if fn is None:
        print(f"# {name}: {reason}", flush=True)
        continue
      causal = shp.causal
      fwd = jax.jit(lambda q, k, v: fn(q, k, v, causal))
      calls = [("fwd", fwd, (q, k, v))]
      if name not in FORWARD_ONLY:
        _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
        bwd = jax.jit(lambda vjp, do: vjp(do))
        calls.append(("bwd", bwd, (vjp, do)))
      tag = f"{name}_{shp.name}".replace("-", "_")
      for direction, f, args in calls:
        jax.block_until_ready(f(*args))  # compile and warm up
        mark = _marker(f"{tag}_{direction}")
        start()
        mark()
        jax.block_until_ready(f(*args))
        stop()
      print(f"# profiled {tag}", flush=True)


_HEADLINE = {
    "Duration": "us", "Compute (SM) Throughput": "sm%", "Memory Throughput": "mem%",
    "Registers Per Thread": "regs", "Achieved Occupancy": "occ%",
    "Issue Slots Busy": "issue%", "Dynamic Shared Memory Per Block": "smem",
}


def _short(kernel: str) -> str:
  kernel = kernel.split("(")[0]
  return kernel if len(kernel) <= 48 else kernel[:45] + "..."


def summarize(path: str) -> str:
  """One row per profiled kernel, grouped under the call its marker names."""
  rows = collections.OrderedDict()
  with open(path, newline="") as f:
    lines = [l for l in f if l.startswith('"')]  # ncu prints its own lines too
  for rec in csv.DictReader(lines):
    key = (rec["ID"], rec["Kernel Name"])
    row = rows.setdefault(key, {})
    metric, unit, value = rec["Metric Name"], rec.get("Metric Unit", ""), rec["Metric Value"]
    if metric in _HEADLINE:
      value = value.replace(",", "")
      if metric == "Duration":  # ncu picks the unit per kernel
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                 "msecond": 1e3, "s": 1e6, "second": 1e6}
        value = f"{float(value) * scale.get(unit, 1.0):.1f}"
      row[_HEADLINE[metric]] = value
    elif metric.startswith(("sm__", "smsp__", "l1tex__")):
      row[metric.split(".")[0].replace("sm__", "")] = value
  out, call, total = [], None, 0.0

  def close():
    if call:
      out.append(f"  total {total:.1f} us")
  for (_, kernel), row in rows.items():
    m = _MARK.search(kernel)
    if m:
      close()
      call, total = f"{m.group(1)} {m.group(2)}", 0.0
      out.append(f"\n== {call}")
      continue
    total += float(row.get("us", 0) or 0)
    cells = " ".join(f"{k}={v}" for k, v in row.items())
    out.append(f"  {_short(kernel):48s} {cells}")
  close()
  return "\n".join(out)


def main(argv):
  if argv and argv[0] == "summarize":
    print(summarize(argv[1]))
    return
  if len(argv) < 3 or argv[0] != "run":
    sys.exit(__doc__)
  causal = (False, True)
  if "--causal" in argv:
    causal = tuple(bool(int(c)) for c in argv[argv.index("--causal") + 1].split(","))
  run(argv[1].split(","), argv[2].split(","), causal)


if __name__ == "__main__":
  main(sys.argv[1:])
