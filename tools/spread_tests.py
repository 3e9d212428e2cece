"""A test selection dealt over a host's GPUs: one pytest per GPU.

  python -m tools.spread_tests [--gpus N] [--workers W] [--limit S] [--out DIR]
                               [--dry-run] PYTEST_ARGS...

Collects the cases PYTEST_ARGS select, deals them round-robin over N GPUs
(default: those ``CUDA_VISIBLE_DEVICES`` lists, else every GPU
``nvidia-smi`` lists) and runs one pytest per GPU, its
``CUDA_VISIBLE_DEVICES`` that GPU alone, with W workers each (pytest-xdist's
``-n``; 0 runs them in the one process). The GPU suites spend most of their time
compiling on the host's CPUs, so one GPU's pytest leaves the others idle: on
four H200s (2026-11-28) all 273 cases of ``mosaic_test.py`` and
``mosaic_check_test.py`` ran in 8 min this way, where one pytest of 6 workers
on one GPU had not finished them in 7. Each GPU's log goes to
``DIR/test-gpu<N>.log`` (default /tmp/out); the runs stop S seconds after the
start, collection included (default 540). Pytest options other than paths
(``-x``, ``--tb``, ``-k``) go to every run too. Prints each GPU's summary line
and the failures, and exits non-zero when a pytest failed or ran out of time. ``--dry-run`` prints the
commands and how many cases each gets, and runs nothing. Run it from the
repository root: node ids are relative to pytest's rootdir.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

# Verbosity changes what --collect-only prints; the node ids need -q alone.
_VERBOSITY = {"-q", "-qq", "-v", "-vv", "--quiet", "--verbose"}


def run_env(device: str) -> dict:
  """The environment of one GPU's pytest: that GPU alone, and JAX's client
  allocating as it goes unless the caller chose otherwise. By default each
  process takes 75% of the GPU's memory at its start, which leaves too little
  for a GPU's other xdist workers: on two H200s (2026-11-29) four workers per
  GPU without this setting failed most cases and two workers aborted in a
  transfer; with it, the cases of a rerun passed."""
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=device)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  return env


def collect(pytest_args: list[str], timeout: float) -> list[str]:
  """The node ids ``pytest --collect-only`` lists for ``pytest_args``."""
  args = [a for a in pytest_args if a not in _VERBOSITY]
  res = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
       *args], capture_output=True, text=True, timeout=timeout)
  ids = [line for line in res.stdout.splitlines() if "::" in line]
  if res.returncode not in (0, 5) or not ids:
    raise SystemExit(f"collecting {' '.join(args)} gave no cases "
                     f"(pytest exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
  return ids


def run_options(pytest_args: list[str]) -> list[str]:
  """``pytest_args`` without the paths and node ids, which the dealt ids
  replace."""
  return [a for a in pytest_args
          if a.startswith("-") or not os.path.exists(a.split("::")[0])]


def deal(ids: list[str], gpus: int) -> list[list[str]]:
  """Round-robin, so that a test's parametrized cases, which sit together
  and often compile alike, spread over the GPUs."""
  return [ids[g::gpus] for g in range(gpus)]


def visible_gpus() -> list[str]:
  """``CUDA_VISIBLE_DEVICES``'s entries, else every GPU ``nvidia-smi`` lists."""
  listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
  if listed:
    return [d.strip() for d in listed.split(",") if d.strip()]
  try:
    res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  except OSError:
    return ["0"]
  n = sum(line.startswith("GPU ") for line in res.stdout.splitlines())
  return [str(i) for i in range(max(n, 1))]


def command(ids: list[str], workers: int, options: list[str] = ()) -> list[str]:
  return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
          *(["-n", str(workers)] if workers else []), *options, *ids]


def main(argv=None) -> int:
  deadline = time.monotonic()
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
  p.add_argument("--gpus", type=int, default=0,
                 help="GPUs to deal over, the first of those visible (0: all)")
  p.add_argument("--workers", type=int, default=3, help="pytest-xdist workers per GPU")
  p.add_argument("--limit", type=int, default=540, help="seconds in all")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
  p.add_argument("--dry-run", action="store_true")
  args, pytest_args = p.parse_known_args(argv)
  if args.gpus < 0 or args.workers < 0 or args.limit <= 0:
    p.error(f"--gpus and --workers take 0 or more and --limit more than 0, got "
            f"{args.gpus}, {args.workers} and {args.limit}")
  deadline += args.limit
  devices = visible_gpus()
  if args.gpus:  # the first N visible, or N by index where fewer are listed
    devices = (devices[:args.gpus] if len(devices) >= args.gpus
               else [str(i) for i in range(args.gpus)])
  chunks = deal(collect(pytest_args, args.limit), len(devices))
  options = run_options(pytest_args)
  plan = [(d, c) for d, c in zip(devices, chunks) if c]
  if args.dry_run:
    for d, chunk in plan:
      print(f"CUDA_VISIBLE_DEVICES={d} {' '.join(command([], args.workers, options)[1:])} "
            f"<{len(chunk)} cases>")
    return 0
  os.makedirs(args.out, exist_ok=True)
  runs, failed = [], False
  try:
    for d, chunk in plan:
      log = open(os.path.join(args.out, f"test-gpu{d}.log"), "w")
      runs.append((d, log, subprocess.Popen(
          command(chunk, args.workers, options), stdout=log, stderr=subprocess.STDOUT,
          env=run_env(d), start_new_session=True)))
    for d, log, proc in runs:
      try:
        rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        rc = None
        print(f"GPU {d}: stopped at the {args.limit} s limit")
      failed |= rc != 0
  finally:
    for d, log, proc in runs:
      if proc.poll() is None:  # its xdist workers too: they hold the GPU
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
      log.close()
  for d, log, _ in runs:
    with open(log.name) as f:
      lines = f.read().splitlines()
    print(f"GPU {d}: {lines[-1] if lines else '(no output)'}")
    for line in lines:
      if line.startswith(("FAILED", "ERROR")):
        print(f"  {line}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
