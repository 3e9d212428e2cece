"""A test selection dealt over a host's GPUs: one pytest per GPU.

  python -m tools.spread_tests [--gpus N] [--workers W] [--limit S] [--out DIR]
                               [--dry-run] PYTEST_ARGS...

Collects the cases PYTEST_ARGS select, deals them round-robin over N GPUs
(default: every GPU ``nvidia-smi`` lists) and runs one pytest per GPU, its
``CUDA_VISIBLE_DEVICES`` that GPU alone, with W workers each (pytest-xdist's
``-n``; 0 runs them in the one process). The GPU suites spend most of their time
compiling on the host's CPUs, so one GPU's pytest leaves the others idle: on
four H200s (2026-11-28) all 273 cases of ``mosaic_test.py`` and
``mosaic_check_test.py`` ran in 8 min this way, where one pytest of 6 workers
on one GPU had not finished them in 7. Each GPU's log goes to
``DIR/test-gpu<N>.log`` (default /tmp/out); each pytest stops after S seconds
(default 540). Prints each GPU's summary line and the failures, and exits
non-zero when a pytest failed or ran out of time. ``--dry-run`` prints the
commands and how many cases each gets, and runs nothing. Run it from the
repository root: node ids are relative to pytest's rootdir.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def collect(pytest_args: list[str]) -> list[str]:
  """The node ids ``pytest --collect-only`` lists for ``pytest_args``."""
  res = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
       *pytest_args], capture_output=True, text=True)
  ids = [line for line in res.stdout.splitlines() if "::" in line]
  if res.returncode not in (0, 5) or not ids:
    raise SystemExit(f"collecting {' '.join(pytest_args)} gave no cases "
                     f"(pytest exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
  return ids


def deal(ids: list[str], gpus: int) -> list[list[str]]:
  """Round-robin, so that a test's parametrized cases, which sit together
  and often compile alike, spread over the GPUs."""
  return [ids[g::gpus] for g in range(gpus)]


def gpu_count() -> int:
  res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return max(1, sum(line.startswith("GPU ") for line in res.stdout.splitlines()))


def command(ids: list[str], workers: int) -> list[str]:
  return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
          *(["-n", str(workers)] if workers else []), *ids]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
  p.add_argument("--gpus", type=int, default=0, help="GPUs to deal over (0: all)")
  p.add_argument("--workers", type=int, default=3, help="pytest-xdist workers per GPU")
  p.add_argument("--limit", type=int, default=540, help="seconds per GPU's pytest")
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
  p.add_argument("--dry-run", action="store_true")
  args, pytest_args = p.parse_known_args(argv)
  if args.gpus < 0 or args.workers < 0 or args.limit <= 0:
    p.error(f"--gpus and --workers take 0 or more and --limit more than 0, got "
            f"{args.gpus}, {args.workers} and {args.limit}")
  gpus = args.gpus or gpu_count()
  chunks = [c for c in deal(collect(pytest_args), gpus) if c]
  if args.dry_run:
    for g, chunk in enumerate(chunks):
      print(f"CUDA_VISIBLE_DEVICES={g} {' '.join(command([], args.workers)[1:])} "
            f"<{len(chunk)} cases>")
    return 0
  os.makedirs(args.out, exist_ok=True)
  runs = []
  for g, chunk in enumerate(chunks):
    log = open(os.path.join(args.out, f"test-gpu{g}.log"), "w")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(g))
    runs.append((g, log, subprocess.Popen(command(chunk, args.workers), env=env,
                                          stdout=log, stderr=subprocess.STDOUT)))
  failed, deadline = False, time.monotonic() + args.limit
  for g, log, proc in runs:
    try:
      rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      proc.kill()
      rc = proc.wait()
      print(f"GPU {g}: stopped after {args.limit} s")
    log.close()
    failed |= rc != 0
    with open(log.name) as f:
      lines = f.read().splitlines()
    print(f"GPU {g}: {lines[-1] if lines else '(no output)'}")
    for line in lines:
      if line.startswith(("FAILED", "ERROR")):
        print(f"  {line}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
