#!/usr/bin/env bash
# Runs every fuzz target in build-fuzz/ for SECONDS (default 30) each, on a
# fresh copy of its seed corpus (tests/fuzz/seeds.py). Fails if any target
# finds a crash, a leak, undefined behaviour or a broken invariant.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-30}
work=tests/fuzz/corpus-work
rm -rf "$work"
mkdir -p "$work/seeds"
python3 tests/fuzz/seeds.py "$work/seeds" "${DCR_BIN:-build/tools/dcr/dcr}"
for target in build-fuzz/tests/fuzz/*_fuzz; do
  name=$(basename "$target")
  dict=tests/fuzz/${name%_fuzz}.dict
  corpus="$work/$name"
  mkdir -p "$corpus"
  cp "$work/seeds/$name"/* "$corpus"/
  args=(-max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1
        -artifact_prefix="$work/$name-")
  [ -f "$dict" ] && args+=(-dict="$dict")
  echo "fuzz: $name for ${seconds}s on $(ls "$corpus" | wc -l) seeds"
  if ! "$target" "${args[@]}" "$corpus" >"$work/$name.log" 2>&1; then
    tail -n 40 "$work/$name.log"
    echo "fuzz: $name FAILED; reproduce with: $target $work/$name-crash-*" >&2
    exit 1
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$work/$name.log" | sed "s/^/fuzz: $name /"
done
