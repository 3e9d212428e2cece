"""``python -m flashjax.benchmarks``: every implementation side by side.

Runs forward, backward (time of forward+backward minus forward),
forward+backward and, on request, forward mode (``--directions jvp``: ``jax.jvp``,
primal and tangent) of the chosen implementations, one process, one device, on
named shape sets from ``flashjax.common.shapes`` (KV-cache shapes run the
``flash_mha_with_kvcache`` entries, forward only: benchmarks/kvcache.py); checks
each implementation against the reference on a small slice first (a wrong one is
flagged, not ranked); measures the device's copy bandwidth once and sets each
row's K+V GB/s against it ("x copy"); prints a table and writes CSV, Markdown and
PNG plots to ``--out`` (default a new folder under ``./flashjax-bench/`` in the
current directory, never inside the package).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

from flashjax.common import shapes as shapes_lib

from . import impls, kvcache, report, timing


def _parser():
  p = argparse.ArgumentParser(prog="python -m flashjax.benchmarks",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", help="comma-separated shape sets "
                 f"({', '.join(shapes_lib.SHAPE_SETS)}); default: standard on "
                 "GPU, cpu on CPU")
  p.add_argument("--shape-names", metavar="PREFIXES",
                 help="comma-separated shape name prefixes: run only the shapes "
                 "of --shapes whose names start with one (e.g. B1-8x2048, to "
                 "split a long set over several runs)")
  p.add_argument("--impls", help="comma-separated implementations "
                 f"({', '.join(impls.IMPLS)}); default: all for this backend but "
                 "the pallas-single-pass and pallas-two-kernels variants")
  p.add_argument("--directions", default="fwd,bwd,fwd_bwd",
                 help="comma-separated, of fwd, bwd, fwd_bwd and jvp (jax.jvp in "
                 "q, k, v: the forward and its tangent)")
  p.add_argument("--dtype", help="default bfloat16 on GPU/TPU, float32 on CPU")
  p.add_argument("--baseline", help="default jax-cudnn on GPU, jax-xla elsewhere")
  p.add_argument("--iters", type=int, help="calls per timing sample")
  p.add_argument("--repeats", type=int, help="timing samples (median taken)")
  p.add_argument("--memory-sweep", default="",
                 help="comma-separated S: compiled fwd+bwd memory of xla and "
                 "jax-xla at B=1, H=8, D=64 (compile only)")
  p.add_argument("--ring", type=int, metavar="S",
                 help="ring mode: sequence length S split over every device "
                 "present; ring attention vs the partitioned call (Auto axis) vs "
                 "all-gather vs one device (benchmarks/ring.py), then exit")
  p.add_argument("--ring-shape", default="1,8,64", metavar="B,H,D",
                 help="ring mode: batch, heads and head dim (default 1,8,64)")
  p.add_argument("--ring-masks", default="full,causal",
                 help="ring mode: comma-separated, of full and causal")
  p.add_argument("--ring-modes", help="ring mode: comma-separated name prefixes "
                 "of the modes to run (ring, partitioned, all-gather; default all)")
  p.add_argument("--ring-layers", type=int, default=1, metavar="N",
                 help="ring mode: N calls chained in one jitted function (each "
                 "output the next q, as a model's layers), times per call")
  p.add_argument("--ring-platform", help="ring mode: the flashjax platform "
                 "(default: the backend's)")
  p.add_argument("--quick", action="store_true",
                 help="small set for a smoke run (under 2 minutes on 2 CPU cores)")
  p.add_argument("--out", help="output folder (default ./flashjax-bench/<time>, "
                 "under the current directory)")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--autotune", action="store_true",
                 help="let tunable flashjax kernels time their candidates first "
                 "(FLASHJAX_AUTOTUNE=1; winners cached on disk)")
  return p


def _progress(i, n, label, t0):
  bar = "#" * int(30 * i / n)
  sys.stderr.write(f"\r[{bar:<30}] {i}/{n} {time.time() - t0:5.0f}s {label[:60]:<60}")
  sys.stderr.flush()


def memory_sweep(seqs, dtype):
  out = []
  for name in ("xla", "jax-xla"):
    fn, reason = impls.build(name)
    if fn is None:
      continue
    for s in seqs:
      args = [jax.ShapeDtypeStruct((1, s, 8, 64), dtype)] * 4
      _, fwd_bwd = timing.functions(fn, False)
      out.append({"impl": name, "seq": s, "mib": timing.compiled_mib(fwd_bwd, args)})
  return out


def ring_mode(args, on_cpu: bool) -> int:
  from . import ring
  dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
  env = report.environment()
  if args.ring_layers < 1:
    raise SystemExit(f"--ring-layers takes N >= 1, got {args.ring_layers}")
  print(f"device: {env['device']} x {jax.device_count()}, jax {env['jax']}, "
        f"{env['date']}, dtype {dtype.name}, B,H,D {args.ring_shape}"
        + (f", {args.ring_layers} calls chained, times per call, memory of the chain"
           if args.ring_layers != 1 else ""), flush=True)
  try:
    batch, heads, head_dim = (int(x) for x in args.ring_shape.split(","))
  except ValueError:
    raise SystemExit(f"--ring-shape takes B,H,D (three ints), got "
                     f"{args.ring_shape!r}") from None
  only = args.ring_modes.split(",") if args.ring_modes else None
  try:
    ring.check_modes(only)
  except ValueError as e:
    raise SystemExit(f"--ring-modes: {e}") from None
  masks = args.ring_masks.split(",")
  if set(masks) - {"full", "causal"}:
    raise SystemExit(f"--ring-masks takes full and causal, got {args.ring_masks!r}")
  rows = ring.run(args.ring, dtype=dtype, batch=batch, heads=heads,
                  head_dim=head_dim, causal_flags=[m == "causal" for m in masks],
                  iters=args.iters or (2 if on_cpu else 20),
                  repeats=args.repeats or (3 if on_cpu else 5),
                  platform=args.ring_platform,
                  only=only, layers=args.ring_layers)
  print(ring.table(rows))
  return 1 if any(r.error for r in rows) else 0


def shape_list(set_names, prefixes=None):
  """The shapes of the named sets, each once: sets share shapes (standard,
  head_dim and gqa all hold B2-S8k-H16-D128), and a shape run twice paired each
  row's ratio with the other run's baseline. With ``prefixes``, only the shapes
  whose names start with one of them; ``SystemExit`` naming the prefixes and the
  sets' shapes where none does."""
  out = list({s.name: s for name in set_names for s in shapes_lib.get(name)}.values())
  if prefixes is None:
    return out
  kept = [s for s in out if any(s.name.startswith(p) for p in prefixes)]
  if not kept:
    raise SystemExit(f"--shape-names {','.join(prefixes)!r} matches no shape of "
                     f"{','.join(set_names)}: {', '.join(s.name for s in out)}")
  return kept


def output_dir(out: str | None) -> str:
  """The folder the results go to: ``out`` if given, else a new time-stamped
  folder under ``./flashjax-bench`` (an installed package's folder is not the
  user's to write into)."""
  if out:
    return out
  return os.path.join(os.getcwd(), "flashjax-bench", time.strftime("%Y%m%d-%H%M%S"))


def main(argv=None):
  args = _parser().parse_args(argv)
  if args.autotune:
    os.environ["FLASHJAX_AUTOTUNE"] = "1"
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  if args.ring:
    return ring_mode(args, on_cpu)
  if args.quick:
    args.shapes = args.shapes or "quick"
    args.iters = args.iters or 1
    args.repeats = args.repeats or 3
    args.memory_sweep = args.memory_sweep or "1024,4096,16384"
    args.impls = args.impls or ",".join(
        n for n in ("xla", "jax-xla") if on_cpu) or None
  shape_sets = (args.shapes or ("cpu" if on_cpu else "standard")).split(",")
  names = args.impls.split(",") if args.impls else impls.default_names(backend)
  dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
  baseline = args.baseline or ("jax-xla" if on_cpu else "jax-cudnn")
  iters = args.iters or (2 if on_cpu else 20)
  repeats = args.repeats or (3 if on_cpu else 5)
  directions = args.directions.split(",")
  for d in directions:
    if d not in timing.DIRECTIONS:
      raise SystemExit(f"unknown direction {d!r}; known: {timing.DIRECTIONS}")
  shapes = shape_list(shape_sets, args.shape_names.split(",")
                      if args.shape_names else None)
  env = report.environment()
  print(f"device: {env['device']} ({backend}), jax {env['jax']}, {env['date']}, "
        f"dtype {dtype.name}, baseline {baseline}", flush=True)

  built, skipped = {}, {}
  for n in names:
    fn, reason = impls.build(n)
    if fn is None:
      skipped[n] = reason
    else:
      built[n] = fn
  out_dir = output_dir(args.out)
  os.makedirs(out_dir, exist_ok=True)
  rows, t0 = [], time.time()
  # Per shape, every implementation is timed in interleaved rounds
  # (timing.run_shape), so a shape's ratios share one stretch of device time.
  for i, s in enumerate(shapes):
    _progress(i, len(shapes), s.name, t0)
    rows.extend(timing.run_shape(built, s, dtype, directions, iters=iters,
                                 repeats=repeats))
    # Partial results survive a run that is cut short.
    report.write_csv(rows, os.path.join(out_dir, "results.partial.csv"))
  _progress(len(shapes), len(shapes), "done", t0)
  sys.stderr.write("\n")
  # Measured after the rows: its buffers (2 GiB on an accelerator) would
  # otherwise be every row's allocator peak. A row's K+V GB/s is set against it ("x copy").
  env["copy_gbs"] = timing.copy_gbs(iters=iters, repeats=repeats)
  report.set_ratios(rows, baseline)
  report.set_copy_ratios(rows, env["copy_gbs"])
  sweep = []
  if args.memory_sweep:
    sweep = memory_sweep([int(x) for x in args.memory_sweep.split(",")], dtype)

  print(report.header(env))
  print(report.table(rows, baseline))
  if "jvp" in directions and "fwd" in directions:
    print("\nForward mode against the forward alone:\n" + report.jvp_vs_forward(rows))
  for n, reason in skipped.items():
    print(f"not run: {n}: {reason}")
  if sweep:
    print("\nCompiled memory of forward+backward (B=1, H=8, D=64), MiB:")
    print(report.memory_table(sweep))
  title = f"flashjax benchmark: {', '.join(shape_sets)} ({dtype.name})"
  paths = report.write_all(rows, sweep, env, out_dir, baseline, title,
                           plot=not args.no_plot)
  if rows:
    os.remove(os.path.join(out_dir, "results.partial.csv"))
  print("wrote " + ", ".join(paths.values()))
  # A declared gap (NotImplementedError: a feature the platform lacks) and a
  # direction a KV-cache call does not have are reported in the table, not
  # counted as failures.
  wrong = [r for r in rows if r.status != "ok" and r.status != kvcache.SKIPPED
           and "NotImplementedError" not in r.status]
  return 1 if any(r.impl in ("xla", "pallas", "pallas-triton", "triton",
                             *kvcache.FLASHJAX_ROWS) for r in wrong) else 0
