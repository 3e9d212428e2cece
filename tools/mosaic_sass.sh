#!/usr/bin/env bash
# Reads a Mosaic-GPU kernel's machine code (SASS) off the GPU host, where device
# time is short. Two stages:
#   dump DIR CMD...   on the GPU host: runs CMD with Mosaic's PTX and ptxas-report
#                     dumps on (MOSAIC_GPU_DUMP_PTX, MOSAIC_GPU_DUMP_PTXAS) into
#                     DIR, prints each kernel's spill line and packs the dumps into
#                     DIR/ptx.tar.xz (the host has no nvdisasm, so
#                     MOSAIC_GPU_DUMP_SASS fails there)
#   sass DIR          anywhere with pip access: unpacks DIR/ptx.tar.xz if present,
#                     compiles each entry_N.ptx with CUDA 13's ptxas for sm_90a
#                     (into a venv under ${SASS_VENV:-/tmp/cuda13-tools}) and
#                     disassembles it to entry_N.sass, then prints per kernel its
#                     spills and how many spill stores / loads (STL / LDL) the
#                     SASS holds
# Kernels are numbered in compile order (entry_0, entry_1, ...). On the same PTX,
# ptxas 13.0 reported the spill bytes the H200 host's ptxas reported (2026-11-27).
# Example: bash tools/mosaic_sass.sh dump /tmp/out/dump python3 my_kernel_script.py
set -uo pipefail
usage() { sed -n '2,17p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
stage="$1"; dir="$2"; shift 2
case "$stage" in
  dump)
    [ $# -ge 1 ] || usage
    mkdir -p "$dir"
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$dir" "$@"
    rc=$?
    grep -H "spill" "$dir"/*.ptxas 2>/dev/null
    (cd "$dir" && ls entry_*.ptx > /dev/null 2>&1 &&
      tar cJf ptx.tar.xz entry_*.ptx entry_*.ptxas)
    exit $rc ;;
  sass)
    [ -d "$dir" ] || { echo "no folder $dir" >&2; exit 2; }
    [ -f "$dir/ptx.tar.xz" ] && tar xJf "$dir/ptx.tar.xz" -C "$dir"
    venv="${SASS_VENV:-/tmp/cuda13-tools}"
    bin=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13/bin 2>/dev/null | head -1)
    if [ -z "$bin" ]; then
      python3 -m venv "$venv" && "$venv/bin/pip" install -q "nvidia-cuda-nvcc>=13" \
        "nvidia-cuda-nvdisasm>=13" || exit 1
      bin=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13/bin | head -1)
    fi
    for ptx in "$dir"/entry_*.ptx; do
      [ -e "$ptx" ] || { echo "no entry_*.ptx in $dir" >&2; exit 2; }
      base="${ptx%.ptx}"
      spill=$("$bin/ptxas" -arch=sm_90a -O3 -v "$ptx" -o "$base.cubin" 2>&1 |
              grep -o "[0-9]* bytes spill stores, [0-9]* bytes spill loads")
      "$bin/nvdisasm" -c "$base.cubin" > "$base.sass" || exit 1
      echo "$(basename "$base"): $spill; STL $(grep -c STL "$base.sass")," \
           "LDL $(grep -c LDL "$base.sass") in $(basename "$base").sass"
    done ;;
  *) usage ;;
esac
