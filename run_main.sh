#!/usr/bin/env bash
# The main job on a fresh machine: makes a virtualenv, installs flashjax, runs flash
# attention on the default backend against the reference and prints speed and
# memory (the benchmark CLI's --quick set). Its CSV, Markdown and PNG go to
# ./flashjax-bench/<time>/ under the directory this is run from (or --out DIR).
# Extra arguments go to the CLI.
set -euo pipefail
here="$PWD"
cd "$(dirname "$0")"
venv="${FLASHJAX_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[tests,bench]"
py="$(cd "$venv" && pwd)/bin/python"
cd "$here"
exec "$py" -m flashjax.benchmarks --quick "$@"
