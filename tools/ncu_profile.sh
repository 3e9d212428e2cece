#!/usr/bin/env bash
# On a GPU host without network (wheels installed by offline_gpu.sh): per-kernel
# Nsight Compute profile (kernel_profile.py) of
# the Mosaic backward and forward against cuDNN and FlashAttention-3 (B2 S8k, and
# B8 S2k without FA3), and of the Pallas-Triton forward against JAX's example.
# Clocks are left alone (--clock-control none): the numbers are those of the GPU's
# default clocks, as in the benchmark CLI.
# Writes raw CSVs and per-call summaries under $OUT.
set -u
cd "$(dirname "$0")/.."
bash tools/offline_gpu.sh info > $OUT/info.txt 2>&1
export PYTHONPATH=/tmp/pkgs:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
python3 -c "import cupy; cupy.cuda.runtime.profilerStart; print('cupy', cupy.__version__)" >> $OUT/info.txt 2>&1
ncu --version >> $OUT/info.txt 2>&1
ncu --query-metrics --chip gh100 > $OUT/metrics.txt 2>&1
M=gpu__time_duration.sum
for m in sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_op_hmma_cycles_active sm__pipe_alu_cycles_active sm__pipe_fma_cycles_active sm__pipe_xu_cycles_active sm__pipe_shared_cycles_active; do grep -q "^$m " $OUT/metrics.txt && M="$M,$m.avg.pct_of_peak_sustained_active"; done
grep -q "^sm__ops_path_tensor_src_bf16_dst_fp32 " $OUT/metrics.txt && M="$M,sm__ops_path_tensor_src_bf16_dst_fp32.sum"
echo "$M" >> $OUT/info.txt
N="ncu --profile-from-start off --clock-control none --csv --page details --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --metrics $M"
timeout 330 $N python3 -m tools.kernel_profile run pallas,jax-cudnn,flash-attn3-jax,pallas-triton,jax-pallas-triton B2-S8k > $OUT/prof-b2s8k.csv 2> $OUT/prof-b2s8k.err; echo "rc $?" >> $OUT/info.txt
timeout 200 $N python3 -m tools.kernel_profile run pallas,jax-cudnn B8-S2k > $OUT/prof-b8s2k.csv 2> $OUT/prof-b8s2k.err; echo "rc $?" >> $OUT/info.txt
for f in b2s8k b8s2k; do python3 -m tools.kernel_profile summarize $OUT/prof-$f.csv > $OUT/summary-$f.txt 2>&1; done
cat $OUT/info.txt | tail -8; tail -5 $OUT/prof-b2s8k.err; cat $OUT/summary-b2s8k.txt | cut -c1-400 | head -60
