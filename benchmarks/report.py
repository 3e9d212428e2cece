"""Reports: terminal table, CSV, PNG plots."""

from __future__ import annotations

import csv
import dataclasses
import os

from .timing import Row


def environment() -> dict:
  import datetime
  import platform

  import jax
  dev = jax.devices()[0]
  kind = getattr(dev, "device_kind", str(dev))
  if jax.default_backend() == "cpu":
    kind = f"{_cpu_model()} x{os.cpu_count()}"
  return {"device": kind,
          "backend": jax.default_backend(), "jax": jax.__version__,
          "python": platform.python_version(),
          "date": datetime.date.today().isoformat()}


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return "cpu"


def set_ratios(rows: list[Row], baseline: str):
  """ratio = baseline's time / this row's time, per (shape, direction)."""
  base = {(r.shape, r.direction): r.ms for r in rows
          if r.impl == baseline and r.status == "ok" and r.ms}
  for r in rows:
    b = base.get((r.shape, r.direction))
    r.ratio = b / r.ms if (b and r.ms and r.status == "ok") else None


def set_copy_ratios(rows: list[Row], copy_gbs: float | None):
  """x_copy = the row's K+V GB/s / the device's copy GB/s, for rows with GB/s."""
  for r in rows:
    r.x_copy = r.gbs / copy_gbs if (r.gbs and copy_gbs) else None


def header(env: dict) -> str:
  """Device, jax, date and, once measured, the copy bandwidth."""
  line = f"{env['device']} ({env['backend']}), jax {env['jax']}, {env['date']}"
  if env.get("copy_gbs"):
    line += f", copy {env['copy_gbs']:.0f} GB/s (read + write)"
  return line


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def table(rows: list[Row], baseline: str) -> str:
  head = ["impl", "shape", "dir", "ms", "TFLOP/s", "K+V GB/s", "x copy",
          f"x {baseline}",
          "compiled MiB", "alloc peak MiB", "status"]
  body = [[r.impl, r.shape, r.direction, _fmt(r.ms, ".3f" if (r.ms or 0) < 10 else ".1f"),
           _fmt(r.tflops, ".3g"), _fmt(r.gbs, ".0f" if (r.gbs or 0) >= 100 else ".3g"),
           _fmt(r.x_copy, ".2f"),
           _fmt(r.ratio, ".2f"), _fmt(r.compiled_mib, ".1f"),
           _fmt(r.alloc_peak_mib, ".0f"), r.status] for r in rows]
  widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
  line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(head), sep] + [line(b) for b in body])


def jvp_vs_forward(rows: list[Row]) -> str:
  """Lines ``impl shape: jvp / fwd = x`` for every (impl, shape) timed in both
  directions: what forward mode costs next to the forward alone."""
  fwd = {(r.impl, r.shape): r.ms for r in rows
         if r.direction == "fwd" and r.status == "ok" and r.ms}
  return "\n".join(
      f"{r.impl} {r.shape}: jvp / fwd = {r.ms / fwd[(r.impl, r.shape)]:.2f}"
      for r in rows if r.direction == "jvp" and r.status == "ok" and r.ms
      and (r.impl, r.shape) in fwd)


def memory_table(sweep: list[dict]) -> str:
  if not sweep:
    return ""
  impls = sorted({m["impl"] for m in sweep})
  seqs = sorted({m["seq"] for m in sweep})
  lines = ["| S | " + " | ".join(f"{i} MiB" for i in impls) + " |",
           "|---|" + "---|" * len(impls)]
  for s in seqs:
    cells = []
    for i in impls:
      hit = [m for m in sweep if m["impl"] == i and m["seq"] == s]
      cells.append(_fmt(hit[0]["mib"], ".1f") if hit else "-")
    lines.append(f"| {s} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_csv(rows: list[Row], path: str):
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=[fld.name for fld in dataclasses.fields(Row)])
    w.writeheader()
    for r in rows:
      w.writerow(dataclasses.asdict(r))


def plot_tflops(rows: list[Row], env: dict, path: str, title: str) -> str | None:
  """TFLOP/s vs sequence length per implementation: one panel per
  (direction, causal). Returns the path, or None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  directions = [d for d in ("fwd", "bwd") if any(r.direction == d for r in rows)]
  if not directions:
    return None
  fig, axes = plt.subplots(len(directions), 2, figsize=(11, 4 * len(directions)),
                           squeeze=False)
  for a, d in enumerate(directions):
    for c, causal in enumerate((False, True)):
      ax = axes[a][c]
      for impl in dict.fromkeys(r.impl for r in rows):
        pts = sorted((r.seq, r.tflops) for r in rows if r.impl == impl and
                     r.direction == d and r.causal == causal and r.tflops)
        if pts:
          ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
      ax.set_xscale("log", base=2)
      ax.set_xlabel("sequence length")
      ax.set_ylabel("TFLOP/s")
      ax.set_title(f"{d}, {'causal' if causal else 'non-causal'}")
      ax.grid(alpha=0.3)
      if ax.lines:
        ax.legend(fontsize=8)
  fig.suptitle(f"{title}\n{env['device']} ({env['backend']}), jax {env['jax']}, "
               f"{env['date']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def write_all(rows, sweep, env, out_dir, baseline, title, plot=True) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  paths = {"csv": os.path.join(out_dir, "results.csv")}
  write_csv(rows, paths["csv"])
  png = plot and plot_tflops(rows, env, os.path.join(out_dir, "tflops.png"), title)
  if png:
    paths["png"] = png
  md = os.path.join(out_dir, "results.md")
  with open(md, "w") as f:
    f.write(header(env) + "\n\n")
    f.write(table(rows, baseline) + "\n")
    if sweep:
      f.write("\nCompiled memory of forward+backward (B=1, H=8, D=64):\n\n")
      f.write(memory_table(sweep) + "\n")
  paths["md"] = md
  return paths
