#!/usr/bin/env bash
# Runs every test dcr has: C++ unit tests (ctest), Python interoperability
# and CLI tests (pytest), and each fuzz target for a short bounded time.
# Installs and builds what it needs first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --python --fuzz

echo "== C++ unit tests"
ctest --test-dir build --output-on-failure -j "$(nproc)"

echo "== Python tests"
DCR_BIN="$PWD/build/tools/dcr/dcr" .venv/bin/python -m pytest -q tests/python

echo "== fuzzing (${DCR_FUZZ_SECONDS:-30} s per target)"
tests/fuzz/run.sh "${DCR_FUZZ_SECONDS:-30}"
