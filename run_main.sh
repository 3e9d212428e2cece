#!/usr/bin/env bash
# The main job on a fresh machine: makes a virtualenv, installs flashjax, runs flash
# attention on the default backend against the reference and prints speed and
# memory (the benchmark CLI's --quick set). Extra arguments go to the CLI.
set -euo pipefail
cd "$(dirname "$0")"
venv="${FLASHJAX_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[tests,bench]"
exec "$venv/bin/python" -m flashjax.benchmarks --quick "$@"
