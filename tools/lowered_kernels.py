"""Fingerprints of the Mosaic-GPU kernels as lowered for CUDA, on any machine
(no GPU needed): one line per program that the lowering test
(``pallas_gpu/tests/mosaic_test.py::test_every_variant_lowers_for_cuda``)
lowers for each of its variants (forward, backward, and the test's own probe),
the sha256 of the lowered text with source locations left out.

A change meant to leave the kernels as they are (moving code into a shared
helper, renaming) must leave every line the same. Run it on the tree before
and after the change and compare::

  python -m tools.lowered_kernels > /tmp/before.txt
  python -m tools.lowered_kernels > /tmp/after.txt
  diff /tmp/before.txt /tmp/after.txt

``-k TEXT`` keeps the variants whose description contains TEXT. All variants
take about two minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import sys


def fingerprints(only: str | None = None) -> list[tuple[str, int, str]]:
  """``(variant, program index, sha256)`` of every lowered program."""
  import jax
  from jax import stages
  from flashjax.pallas_gpu.tests import mosaic_test

  texts: list[str] = []
  as_text = stages.Lowered.as_text

  def recorded(self, *args, **kwargs):
    text = as_text(self, *args, **kwargs)
    texts.append(text)
    return text

  rows = []
  stages.Lowered.as_text = recorded
  # Locations name source lines: without them, moving code is no change.
  limit = jax.config.jax_traceback_in_locations_limit
  jax.config.update("jax_traceback_in_locations_limit", 0)
  try:
    for variant in mosaic_test.VARIANTS:
      name = str(variant)
      if only and only not in name:
        continue
      texts.clear()
      mosaic_test.test_every_variant_lowers_for_cuda(variant)
      rows += [(name, i, hashlib.sha256(t.encode()).hexdigest())
               for i, t in enumerate(texts)]
  finally:
    stages.Lowered.as_text = as_text
    jax.config.update("jax_traceback_in_locations_limit", limit)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("-k", dest="only", help="variants whose description contains this")
  args = p.parse_args(argv)
  rows = fingerprints(args.only)
  if not rows:
    print(f"no variant matches {args.only!r}", file=sys.stderr)
    return 2
  for name, i, digest in rows:
    print(f"{digest} {i} {name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
