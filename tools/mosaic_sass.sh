#!/usr/bin/env bash
# Reads a Mosaic-GPU kernel's machine code (SASS) and spills on a machine other
# than the GPU host, which has no nvdisasm (MOSAIC_GPU_DUMP_SASS fails there).
# Two stages:
#   dump DIR CMD...   on the GPU host: runs CMD with Mosaic's dumps on into DIR
#                     (empty or new), prints each kernel's ptxas spill line and
#                     packs the PTX and ptxas reports into DIR/ptx.tar.xz. Mosaic
#                     writes its MLIR pass logs there too (about 125 MB per
#                     kernel with jax 0.11.2); they are not packed.
#   sass DIR          anywhere with pip access: unpacks DIR/ptx.tar.xz if present,
#                     compiles each kernel's NAME_N.ptx for sm_90a with ptxas
#                     from the pinned CUDA 13.5 pip wheels (a venv under
#                     ${SASS_VENV:-/tmp/cuda13-tools}), disassembles it to
#                     NAME_N.sass and prints the ptxas version, then per kernel
#                     its spills, whether ptxas serialized its wgmmas (C7512),
#                     and the spill stores / loads (STL / LDL) in it.
#                     With REGISTERS=C/M it compiles copies (regsC-M_NAME_N.*)
#                     whose setmaxnreg values are C for the compute warpgroups
#                     (.inc) and M for the memory warpgroup (.dec), to see the
#                     spills of another register split without the GPU host
# Kernels are named by their Pallas body function (entry for plgpu.kernel, body
# for the kernels with an accumulator that pl.kernel runs) and numbered in
# compile order (entry_0, body_1, ...). On two forward
# kernels, ptxas 13.5 reported the spill bytes of the H200 host's ptxas
# (2026-11-27).
# Spill bytes follow the register split: the single-pass backward of 2e88904 spilled
# 280 / 176 / 108 bytes at 232/40, 240/24 and 256/24 (2026-11-29).
# Example: bash tools/mosaic_sass.sh dump /tmp/out/dump python3 my_kernel_script.py
#          REGISTERS=240/24 bash tools/mosaic_sass.sh sass /tmp/out/dump
set -uo pipefail
usage() { sed -n '2,28p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
stage="$1"; dir="$2"; shift 2
case "$stage" in
  dump)
    [ $# -ge 1 ] || usage
    if [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
      echo "$dir is not empty: its old dumps would be packed with the new" >&2
      exit 2
    fi
    mkdir -p "$dir"
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$dir" "$@"
    rc=$?
    if ! ls "$dir"/*_[0-9]*.ptx > /dev/null 2>&1; then
      echo "the command compiled no Mosaic kernel: no NAME_N.ptx in $dir" >&2
      exit $(( rc ? rc : 1 ))
    fi
    grep -H "spill\|C7512" "$dir"/*.ptxas
    (cd "$dir" && tar cJf ptx.tar.xz *_[0-9]*.ptx *_[0-9]*.ptxas) ||
      { echo "could not pack the dumps in $dir" >&2; exit 1; }
    exit $rc ;;
  sass)
    regs="${REGISTERS:-}"
    if [ -n "$regs" ]; then
      inc="${regs%/*}"; dec="${regs#*/}"
      ok() { [[ "$1" =~ ^[0-9]+$ ]] && (( $1 >= 24 && $1 <= 256 && $1 % 8 == 0 )); }
      if [[ "$regs" != */* ]] || ! ok "$inc" || ! ok "$dec"; then
        echo "REGISTERS must be C/M, multiples of 8 from 24 to 256, got '$regs'" >&2
        exit 2
      fi
    fi
    [ -d "$dir" ] || { echo "no folder $dir" >&2; exit 2; }
    if [ -f "$dir/ptx.tar.xz" ]; then tar xJf "$dir/ptx.tar.xz" -C "$dir" || exit 1; fi
    ls "$dir"/*_[0-9]*.ptx > /dev/null 2>&1 || { echo "no NAME_N.ptx in $dir" >&2; exit 2; }
    venv="${SASS_VENV:-/tmp/cuda13-tools}"
    find_bin() { ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13/bin 2>/dev/null | head -1; }
    bin=$(find_bin)
    if [ -z "$bin" ]; then
      python3 -m venv "$venv" && "$venv/bin/pip" install -q "nvidia-cuda-nvcc==13.5.*" \
        "nvidia-cuda-nvdisasm==13.5.*" || exit 1
      bin=$(find_bin)
      [ -n "$bin" ] || { echo "no ptxas in $venv after the install" >&2; exit 1; }
    fi
    "$bin/ptxas" --version | tail -1
    for ptx in "$dir"/*_[0-9]*.ptx; do
      base="${ptx%.ptx}"
      case "$(basename "$base")" in regs*) continue ;; esac  # an earlier run's copies
      if [ -n "$regs" ]; then
        if ! grep -q "setmaxnreg" "$ptx"; then
          echo "$(basename "$base"): no setmaxnreg, REGISTERS does not apply"; continue
        fi
        # One memory warpgroup beside the compute ones: past 64K registers per
        # CTA the launch cannot hand out what setmaxnreg asks for.
        threads=$(grep -o "maxntid [0-9]*" "$ptx" | head -1 | grep -o "[0-9]*$")
        if [ -n "$threads" ] && (( (threads / 128 - 1) * inc + dec > 512 )); then
          echo "note: $((threads / 128 - 1)) x $inc + $dec registers per thread exceed 64K per CTA;" \
               "ptxas compiles it, a launch would not" >&2
        fi
        base="$dir/regs$inc-${dec}_$(basename "$base")"
        sed -e "s/setmaxnreg\.inc\.sync\.aligned\.u32 [0-9]*/setmaxnreg.inc.sync.aligned.u32 $inc/" \
            -e "s/setmaxnreg\.dec\.sync\.aligned\.u32 [0-9]*/setmaxnreg.dec.sync.aligned.u32 $dec/" \
            "$ptx" > "$base.ptx" || exit 1
        ptx="$base.ptx"
      fi
      rm -f "$base.cubin" "$base.sass"
      if ! "$bin/ptxas" -arch=sm_90a -O3 -v "$ptx" -o "$base.cubin" > "$base.ptxas-local" 2>&1; then
        echo "ptxas failed on $ptx:" >&2; cat "$base.ptxas-local" >&2; exit 1
      fi
      spill=$(grep -o "[0-9]* bytes spill stores, [0-9]* bytes spill loads" "$base.ptxas-local")
      "$bin/nvdisasm" -c "$base.cubin" > "$base.sass" || exit 1
      # C7512: ptxas waits for every wgmma right after issuing it when it runs
      # short of registers, so no product overlaps the softmax (the causal
      # single-pass backward on an H200, 2026-11-29: 1.26-1.54x the time of
      # the two kernels).
      serial=""
      grep -q "C7512" "$base.ptxas-local" && serial=" WGMMA SERIALIZED (ptxas C7512);"
      echo "$(basename "$base"): $spill;$serial STL $(grep -c STL "$base.sass")," \
           "LDL $(grep -c LDL "$base.sass") in $(basename "$base").sass"
    done ;;
  *) usage ;;
esac
