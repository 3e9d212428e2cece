#!/usr/bin/env bash
# Experiment: ncu of the backward variants (exp/fused_prof.py) at B2 S8k.
cd "$(dirname "$0")/.."
bash benchmarks/gpu_session.sh info > $OUT/info.txt 2>&1
export PYTHONPATH=/tmp/pkgs:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_red.sum,lts__d_sectors_fill_sysmem.sum,lts__t_sectors_op_red_lookup_miss.sum
timeout 400 ncu --profile-from-start off --clock-control none --csv --page details --section WarpStateStats --section MemoryWorkloadAnalysis --metrics $M python3 -m flashjax.exp.fused_prof "$1" "$2" > $OUT/prof.csv 2> $OUT/prof.err; echo "rc $?"
tail -3 $OUT/prof.err
python3 - $OUT/prof.csv <<'PY'
import csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
cur = None
for rec in csv.DictReader(lines):
  kn = rec["Kernel Name"]
  if kn.startswith("mark_"):
    if cur != kn: print("==", kn); cur = kn
    continue
  key = (rec["ID"], kn[:40])
  m, u, v = rec["Metric Name"], rec.get("Metric Unit", ""), rec["Metric Value"]
  if any(s in m for s in ("Duration", "dram__", "lts__", "gmma", "Stall", "Warp Cycles Per Issued", "L2 Hit", "Mem Busy", "Max Bandwidth", "DRAM Throughput")) or m.startswith("smsp__pcsamp"):
    print(f"  {rec['ID']:>4} {kn[:28]:28s} {m[:60]:60s} {v} {u}")
PY
