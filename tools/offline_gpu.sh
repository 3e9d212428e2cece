#!/usr/bin/env bash
# Runs flashjax on a GPU host that has no network. The wheels it needs (jax with
# its CUDA plugin, triton, jax-triton; peers to benchmark against in .peers/) are
# carried in the checkout's .whl/ (git-ignored) and installed into /tmp/site;
# `import flashjax` is pointed at this checkout. Then it runs one stage, logging
# under $OUT (default /tmp/out):
#   test [pytest args]   the test suite on the GPU
#   spread [pytest args] the selected cases dealt over every GPU of the host,
#                        one pytest each (tools/spread_tests.py; WORKERS each)
#   bench [cli args]     python -m flashjax.benchmarks (output under $OUT/bench)
#   info                 versions and devices
#   py MODULE [args]     python -m MODULE from the checkout (e.g. tools.mosaic_sweep)
# Example: bash tools/offline_gpu.sh test pallas_gpu/tests/mosaic_test.py
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/out}"; mkdir -p "$out"
wheels=$(ls .whl/*.whl .peers/*.whl 2>/dev/null)
[ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile \
  --upgrade --target /tmp/site $wheels > "$out/pip.log" 2>&1
mkdir -p /tmp/pkgs && ln -sfn "$PWD" /tmp/pkgs/flashjax
export PYTHONPATH=/tmp/pkgs:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stage="${1:-info}"; shift || true
case "$stage" in
  info)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import jax, jaxlib, triton; print(jax.__version__, jaxlib.__version__, triton.__version__, jax.devices())" ;;
  test)
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider \
      -n "${WORKERS:-4}" "$@" 2>&1 | tee "$out/test.log" | tail -40 ;;
  spread)
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m tools.spread_tests --out "$out" \
      --workers "${WORKERS:-3}" "$@" 2>&1 | tee "$out/spread.log" ;;
  py)
    python3 -m "$@" 2>&1 | tee "$out/py-$1.log" ;;
  bench)
    python3 -m flashjax.benchmarks --out "$out/bench" "$@" 2>&1 | tee "$out/bench.log" ;;
esac
