#!/usr/bin/env bash
# Runs every test dcr has: C++ unit tests (ctest), Python interoperability
# and CLI tests (pytest), and each fuzz target for a short bounded time.
# Installs and builds what it needs first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --python --fuzz

# A real S3 server for the store tests: a single-node Ceph cluster with
# radosgw (tests/s3/radosgw.sh), stopped on exit whatever happens.
s3_dir=$(mktemp -d /tmp/dcr-radosgw.XXXXXX)
trap 'tests/s3/radosgw.sh stop "$s3_dir" >/dev/null 2>&1 || true' EXIT
echo "== starting radosgw (Ceph, single node) for the S3 tests"
tests/s3/radosgw.sh start "$s3_dir"
set -a
# shellcheck disable=SC1091
. "$s3_dir/env"
set +a
export DCR_S3_TEST_URL="s3://dcr-conformance?create_bucket=1"

echo "== C++ unit tests"
ctest --test-dir build --output-on-failure -j "$(nproc)"

echo "== Python tests"
DCR_BIN="$PWD/build/tools/dcr/dcr" .venv/bin/python -m pytest -q tests/python

echo "== fuzzing (${DCR_FUZZ_SECONDS:-30} s per target)"
tests/fuzz/run.sh "${DCR_FUZZ_SECONDS:-30}"
