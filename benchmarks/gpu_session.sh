#!/usr/bin/env bash
# For the lent GPU machine (no network): installs the carried wheels (.whl/ and, when
# present, .peers/) into /tmp/site, makes `import flashjax` point at this checkout,
# then runs each stage named on the command line, logging under $OUT:
#   test [pytest args]   the test suite on the GPU
#   bench [cli args]     python -m flashjax.benchmarks
#   info                 versions and devices
#   py MODULE [args]     python -m MODULE (e.g. flashjax.benchmarks.mosaic_check)
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
  py)
    python3 -m "$@" 2>&1 | tee "$out/py-$1.log" ;;
  bench)
    python3 -m flashjax.benchmarks --out "$out/bench" "$@" 2>&1 | tee "$out/bench.log" ;;
esac
