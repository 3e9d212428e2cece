"""Where the compute warpgroups of a Mosaic kernel spend their warp-stall samples.

Input: ncu's per-instruction table of one report,
  ncu -i REPORT.ncu-rep --page source --csv --print-source sass > REPORT-sass.csv
Usage: python3 THIS.py REPORT-sass.csv [KERNEL]   (KERNEL: entry_mosaic_gpu_kernel)

The memory warpgroup's code follows its register release (USETMAXREG.DEALLOC),
so everything from there on is counted as "memory warpgroup". An instruction
counts as a consumer of a spill when it reads a register whose last write, in
address order, was a local load (LDL); control flow is ignored, so the count is
an estimate.
"""
import csv
import re
import sys


def load(path, kernel):
  rows, cur = [], None
  for r in csv.reader(open(path)):
    if r and r[0] == "Kernel Name":
      cur = r[1]
    elif cur == kernel and r and r[0].startswith("0x"):
      rows.append((r[1].strip(), int(r[2])))  # SASS, warp stall samples (all)
  return rows


def regs(text):
  return {int(m.group(1)) for m in re.finditer(r"\bR(\d+)\b", text)}


def classify(rows):
  end = next(i for i, (s, _) in enumerate(rows) if "USETMAXREG.DEALLOC" in s)
  classes, held, prev = {}, {}, ""
  for i, (s, n) in enumerate(rows):
    body = re.sub(r"^@!?U?P\w+\s+", "", s)
    op = body.split()[0] if body else ""
    parts = body[len(op):].split(",")
    dst, src = regs(parts[0]), regs(",".join(parts[1:]))
    if op.startswith("ST"):
      dst, src = set(), src | dst
    if i >= end:
      k = "memory warpgroup"
    elif op.startswith(("LDL", "STL")):
      k = "spill load/store"
    elif src & set(held):
      k = "consumer of a spill"
    elif "BRA" in s and "TRYWAIT" in prev:
      k = "mbarrier wait"
    elif "DEPBAR" in s:
      k = "wgmma wait"
    elif op.startswith(("HGMMA", "WARPGROUP.ARRIVE", "R2UR")):
      k = "wgmma issue"
    elif op.startswith(("MEMBAR", "FENCE", "BAR.")):
      k = "fence / bar.sync"
    elif op.startswith(("STS", "LDS", "STSM", "LDSM")):
      k = "shared load/store"
    else:
      k = "other"
    classes[k] = classes.get(k, 0) + n
    for r in dst:
      held.pop(r, None)
    if op.startswith("LDL") and dst:
      width = 2 if ".64" in op else 4 if ".128" in op else 1
      held.update({r: i for r in range(min(dst), min(dst) + width)})
    prev = s
  return classes


if __name__ == "__main__":
  classes = classify(load(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else
                          "entry_mosaic_gpu_kernel"))
  total = sum(classes.values())
  print(f"{'samples':30s} {total:9d}")
  for k, v in sorted(classes.items(), key=lambda x: -x[1]):
    print(f"{k:30s} {v:9d} {100 * v / total:5.1f}%")
