#!/usr/bin/env bash
# Runs the libFuzzer targets in build-fuzz/ (scripts/setup.sh --fuzz: ASan +
# UBSan + fuzzer coverage) on their seeds (tests/fuzz/seeds.py) plus the
# corpus kept in the repo (tests/fuzz/corpus/<target>/). Fails if any target
# finds a crash, a leak, undefined behaviour, a broken invariant or a hang.
#
#   tests/fuzz/run.sh [SECONDS]
#       SECONDS (default 30) per target, on a work copy (tests/fuzz/corpus-work/):
#       reads the repo's corpus, writes nothing in the repo. What CI runs.
#   tests/fuzz/run.sh --accumulate SECONDS [--goal EXECS] [--until TIME] [TARGET...]
#       builds build-fuzz/ (DCR_FUZZ_BUILD=0: not) and runs copies of its targets
#       SECONDS per target (in slices of at most $DCR_FUZZ_SLICE s, default 600),
#       then after each slice: merges what it found back into the repo's corpus
#       (-merge=1 into a fresh directory: a minimal set, smaller inputs first) and
#       appends the executions to tests/fuzz/executions.tsv (date, commit the
#       targets were built from, target, seconds, executions, corpus files,
#       result), so that runs build
#       on each other and totals add up across runs and machines. With --goal, a
#       target stops once its total in the ledger reaches EXECS (skipped if it
#       has). With --until (anything `date -d` reads, e.g. 16:00), nothing runs
#       past TIME. TARGET names (e.g. frame_fuzz) limit the run to those.
#   tests/fuzz/run.sh --totals
#       the executions per target in the ledger, summed.
#
# Per-target libFuzzer flags (e.g. -max_len) are in tests/fuzz/<target>.options,
# one per line; a dictionary, if any, in tests/fuzz/<name>.dict.
# DCR_FUZZ_CPU=N runs the targets on CPU N alone (taskset): for runs side by
# side, and 2-3x faster for s3_response_fuzz, whose driver hands each request
# to a thread and back (a wake-up on the same CPU costs less).
# DCR_FUZZ_TIMEOUT=S (default 10): libFuzzer's per-input wall-clock limit, the
# hang detector; raise it for long runs beside other work on a shared machine,
# where a descheduled target can pass 10 s on an input that takes milliseconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo_corpus=tests/fuzz/corpus
ledger=tests/fuzz/executions.tsv

totals() {
  [ -f "$ledger" ] || { echo "no ledger yet ($ledger)"; return; }
  printf "%-26s %14s %10s %6s %s\n" target executions seconds runs failed
  awk -F'\t' 'NR > 1 { e[$3] += $5; s[$3] += $4; r[$3]++; if ($7 != "ok") bad[$3]++ }
    END { for (t in e) printf "%-26s %14d %10d %6d %d\n", t, e[t], s[t], r[t], bad[t] + 0 }' "$ledger" | sort
}

mode=ci
seconds=30
timeout=${DCR_FUZZ_TIMEOUT:-10}
goal=0
until=0
only=()
case "${1:-}" in
  --totals) totals; exit 0 ;;
  --accumulate)
    mode=accumulate
    [ $# -ge 2 ] || { echo "usage: run.sh --accumulate SECONDS [--goal EXECS] [--until TIME] [TARGET...]" >&2; exit 2; }
    seconds=$2; shift 2
    while [ $# -gt 0 ]; do
      case "$1" in
        --goal) goal=$2; shift 2 ;;
        --until) until=$(date -d "$2" +%s); shift 2 ;;
        *) only+=("$1"); shift ;;
      esac
    done ;;
  -*) echo "usage: run.sh [SECONDS] | --accumulate SECONDS [--goal EXECS] [--until TIME] [TARGET...] | --totals" >&2
      exit 2 ;;
  "") ;;
  *) seconds=$1 ;;
esac
slice=${DCR_FUZZ_SLICE:-600}

if [ "$mode" = ci ]; then
  work=tests/fuzz/corpus-work
  rm -rf "$work"
  mkdir -p "$work"
else
  # Not tests/fuzz/corpus-work: a CI run (scripts/test.sh) beside this one empties that.
  work=$(mktemp -d "${TMPDIR:-/tmp}/dcr-fuzz-accumulate.XXXXXX")
fi
mkdir -p "$work/seeds"
python3 tests/fuzz/seeds.py "$work/seeds" "${DCR_BIN:-build/tools/dcr/dcr}"

if [ "$mode" = accumulate ] && [ "${DCR_FUZZ_BUILD:-1}" = 1 ]; then
  # The ledger names the commit the executions ran on: the targets must be built from it.
  echo "fuzz: building build-fuzz (DCR_FUZZ_BUILD=0 skips this)"
  cmake --build build-fuzz --target fuzzers -j "${DCR_FUZZ_BUILD_JOBS:-$(nproc)}" >"$work/build.log" 2>&1 ||
    { tail -n 30 "$work/build.log"; echo "fuzz: the build failed" >&2; exit 1; }
fi
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
targets=(build-fuzz/tests/fuzz/*_fuzz)
if [ "$mode" = accumulate ]; then
  # Copies: a rebuild of build-fuzz/ during the run does not change what the ledger's commit names.
  mkdir -p "$work/bin"
  cp build-fuzz/tests/fuzz/*_fuzz "$work/bin/"
  targets=("$work"/bin/*_fuzz)
fi
# +dirty: the sources the fuzz targets are built from differ from the commit.
[ -z "$(git status --porcelain --untracked-files=no -- src include 'tests/fuzz/*.cc' tests/fuzz/CMakeLists.txt \
        CMakeLists.txt 2>/dev/null)" ] || commit="$commit+dirty"

ledger_total() {  # executions of target $1 in the ledger
  [ -f "$ledger" ] || { echo 0; return; }
  awk -F'\t' -v t="$1" 'NR > 1 && $3 == t { s += $5 } END { printf "%d\n", s }' "$ledger"
}

target_flags() {  # libFuzzer flags for target $1: the .options file and the dictionary
  local name=$1 opts=tests/fuzz/$1.options dict=tests/fuzz/${1%_fuzz}.dict
  [ -f "$opts" ] && grep -v '^[[:space:]]*\(#\|$\)' "$opts"
  [ -f "$dict" ] && echo "-dict=$dict"
  return 0
}

failed() {  # $1 name, $2 log, $3 artifact prefix
  tail -n 40 "$2"
  echo "fuzz: $1 FAILED; the log is $2; reproduce with: build-fuzz/tests/fuzz/$1 $3crash-* (or leak-*, timeout-*, oom-*)" >&2
}

pin=()
if [ -n "${DCR_FUZZ_CPU:-}" ]; then pin=(taskset -c "$DCR_FUZZ_CPU"); fi

status=0
for target in "${targets[@]}"; do
  name=$(basename "$target")
  if [ "${#only[@]}" -gt 0 ] && [[ " ${only[*]} " != *" $name "* ]]; then continue; fi
  mapfile -t flags < <(target_flags "$name")
  corpus="$work/$name"
  mkdir -p "$corpus"
  cp "$work/seeds/$name"/* "$corpus"/
  if [ -d "$repo_corpus/$name" ]; then cp "$repo_corpus/$name"/* "$corpus"/ 2>/dev/null || true; fi
  base=(-rss_limit_mb=2048 -timeout="$timeout" -print_final_stats=1 -artifact_prefix="$work/$name-" "${flags[@]}")

  if [ "$mode" = ci ]; then
    echo "fuzz: $name for ${seconds}s on $(ls "$corpus" | wc -l) inputs"
    if ! "${pin[@]}" "$target" "${base[@]}" -max_total_time="$seconds" "$corpus" >"$work/$name.log" 2>&1; then
      failed "$name" "$work/$name.log" "$work/$name-"
      exit 1
    fi
    grep -E "stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb" "$work/$name.log" |
      sed "s/^/fuzz: $name /"
    continue
  fi

  left=$seconds
  round=0
  while [ "$left" -gt 0 ]; do
    have=$(ledger_total "$name")
    runs=-1
    if [ "$goal" -gt 0 ]; then
      if [ "$have" -ge "$goal" ]; then echo "fuzz: $name has $have executions, goal $goal reached"; break; fi
      runs=$((goal - have))
    fi
    t=$((left < slice ? left : slice))
    if [ "$until" -gt 0 ]; then
      remaining=$((until - $(date +%s)))
      if [ "$remaining" -lt 5 ]; then echo "fuzz: $name: out of time (--until)"; break; fi
      t=$((t < remaining ? t : remaining))
    fi
    left=$((left - t))
    round=$((round + 1))
    log="$work/$name.$round.log"
    echo "fuzz: $name for ${t}s on $(ls "$corpus" | wc -l) inputs ($have executions so far) [$(date -u +%H:%M:%S)]"
    result=ok
    if ! "${pin[@]}" "$target" "${base[@]}" -max_total_time="$t" -runs="$runs" "$corpus" >"$log" 2>&1; then
      result=FAILED
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    [ -n "$execs" ] || execs=0
    # The fuzzed seconds: executions / rate when both are known, else the slice.
    secs=$t
    if [ -n "$rate" ] && [ "$rate" -gt 0 ]; then secs=$(( (execs + rate / 2) / rate )); fi
    # Merge what it found into a fresh, minimal corpus that replaces the repo's.
    if [ "$result" = ok ]; then
      fresh="$work/$name.merged"
      rm -rf "$fresh"
      mkdir -p "$fresh" "$repo_corpus/$name"
      if "${pin[@]}" "$target" -merge=1 -rss_limit_mb=2048 -timeout="$timeout" "${flags[@]}" "$fresh" "$corpus" \
          >"$work/$name.$round.merge.log" 2>&1; then
        rm -rf "${repo_corpus:?}/$name.old"
        mv "$repo_corpus/$name" "$repo_corpus/$name.old"
        mv "$fresh" "$repo_corpus/$name"
        rm -rf "${repo_corpus:?}/$name.old"
      else
        tail -n 20 "$work/$name.$round.merge.log"
        result=FAILED
      fi
    fi
    [ -f "$ledger" ] || printf 'date\tcommit\ttarget\tseconds\texecutions\tcorpus_files\tresult\n' >"$ledger"
    files=$(ls "$repo_corpus/$name" 2>/dev/null | wc -l)
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$commit" "$name" "$secs" "$execs" \
      "$files" "$result" >>"$ledger"
    echo "fuzz: $name $execs executions at ${rate:-?}/s, corpus $files files $(du -s --apparent-size -B1K "$repo_corpus/$name" | cut -f1) KB, total $(ledger_total "$name"): $result"
    if [ "$result" != ok ]; then
      failed "$name" "$log" "$work/$name-"
      status=1
      break
    fi
    # The next slice starts from the merged corpus.
    rm -rf "$corpus"
    mkdir -p "$corpus"
    cp "$repo_corpus/$name"/* "$corpus"/ 2>/dev/null || true
  done
  [ "$status" = 0 ] || break
done

if [ "$mode" = accumulate ]; then
  if [ "$status" = 0 ]; then rm -rf "$work"; else echo "fuzz: the work directory $work is kept" >&2; fi
  totals
fi
exit "$status"
