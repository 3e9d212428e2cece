#!/usr/bin/env bash
# Ring attention on a host with several GPUs, in one command: the GPU tests, the
# scaling runs (8k and 32k tokens per GPU, causal, bf16, B1 H16 D128) on 2, 4 and
# 8 GPUs up to the host's count (CUDA_VISIBLE_DEVICES picks them; each run's "one
# device" row is the 1-GPU time), and the overlap profile on every GPU. Logs go
# under $OUT (default /tmp/out), one file per run.
#   bash tools/ring_gpu_runs.sh [--dry-run] [MAX_GPUS]
# Each run has its own limit (RUN_LIMIT seconds, default 500), so one slow run
# does not take the others' time; --dry-run prints the commands only. To split
# the work over several shorter runs: RING_COUNTS (default "2 4 8") picks the
# GPU counts of the scaling runs, RING_PARTS (default "tests scaling profile")
# the parts; WORKERS (default 3) the test processes (on four GPUs, 4 workers ran
# the GPU tests in 222 s, 2026-11-26).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out="${OUT:-/tmp/out}"
gpus="${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
limit="${RUN_LIMIT:-500}"
counts="${RING_COUNTS:-2 4 8}"
parts=" ${RING_PARTS:-tests scaling profile} "
for part in $parts; do
  case "$part" in
    tests|scaling|profile) ;;
    *) echo "RING_PARTS takes tests, scaling and profile (space-separated), got '$part'" >&2
       exit 2 ;;
  esac
done
export NCCL_NVLS_ENABLE=0  # NVLink multicast off, as the hosts require

run() {  # run LOG COMMAND...
  local log="$1"; shift
  echo "+ $* > $out/$log"
  [ "$dry" = 1 ] && return 0
  mkdir -p "$out"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$log" 2>&1
  echo "  rc $? ($log, $((SECONDS - t0)) s)"
}

if [[ "$parts" == *" tests "* ]]; then
  run ring-tests.log env WORKERS="${WORKERS:-3}" bash tools/offline_gpu.sh test \
    tests/ring_test.py tests/sharding_test.py -k gpus -rA
fi
if [[ "$parts" == *" scaling "* ]]; then
  for n in $counts; do
    [ "$n" -le "$gpus" ] || continue
    devices=$(seq -s, 0 $((n - 1)))
    for per in 8192 32768; do
      extra=()
      [ "$per" = 32768 ] && extra=(--iters 3 --repeats 3)
      run "ring-$n-gpus-$per.log" env CUDA_VISIBLE_DEVICES="$devices" \
        bash tools/offline_gpu.sh py flashjax.benchmarks --ring $((per * n)) \
        --ring-shape 1,16,128 --ring-masks causal "${extra[@]}"
    done
  done
fi
if [[ "$parts" == *" profile "* ]]; then
  run ring-profile.log bash tools/offline_gpu.sh py tools.ring_profile $((8192 * gpus))
fi
