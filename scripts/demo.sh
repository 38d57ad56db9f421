#!/usr/bin/env bash
# The main job on the embedded default store (a local directory): builds dcr,
# generates version 0 and several steps of a simulated training run of a
# Qwen3-MoE-like model, then runs a real refit: one publisher and three
# receivers as separate processes, every version published through the store
# and applied in place. Prints per version the frame bytes, the refit time and
# the ratio to copying the full checkpoint through the same store, and ends by
# checking every receiver byte for byte against the last version.
#
# Knobs (environment): DCR_DEMO_SIZE (default 2GB), DCR_DEMO_VERSIONS (4),
# DCR_DEMO_RATE (0.02 of elements change per step), DCR_DEMO_DIR (out/demo),
# DCR_DEMO_MBPS (limit each process's store link to this many MB/s; default
# unlimited).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
dcr=$PWD/build/tools/dcr/dcr
size=${DCR_DEMO_SIZE:-2GB}
versions=${DCR_DEMO_VERSIONS:-4}
rate=${DCR_DEMO_RATE:-0.02}
out=${DCR_DEMO_DIR:-out/demo}
mkdir -p "$out"
out=$(cd "$out" && pwd)
store="file://$out/store"
if [ -n "${DCR_DEMO_MBPS:-}" ]; then export DCR_STORE_FAULTS="mbps=$DCR_DEMO_MBPS"; fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# Reuse generated versions when the parameters match (generation is slow).
params="$size $versions $rate"
if [ "$(cat "$out/gen/params" 2>/dev/null)" != "$params" ]; then
  rm -rf "$out/gen"
  echo "== dcr gen: version 0 and $versions training steps of a $size Qwen3-MoE-like model ($rate changed per step)"
  $dcr gen -o "$out/gen" --family qwen3-moe --size "$size" --versions "$versions" --update training --rate "$rate" --seed 42
  echo "$params" > "$out/gen/params"
fi
rm -rf "$out/store" "$out"/receiver-* "$out/full"
read -r total elements < <($dcr inspect --json "$out/gen/v0" | python3 -c \
  'import json,sys; d=json.load(sys.stdin); print(d["total_bytes"], d["total_elements"])')

echo
echo "== publish version 0: the run and its snapshot ($store)"
# The publisher's state (its baseline, a cache of the store) is in memory by default.
$dcr publish --store "$store" --version 0 "$out/gen/v0"

echo
echo "== three receivers join from the snapshot and follow (logs in $out/receiver-N.log)"
for i in 1 2 3; do
  $dcr follow --store "$store" --id "receiver-$i" --until "$versions" --poll 0.05 "$out/receiver-$i" \
    > "$out/receiver-$i.log" 2>&1 &
  pids+=($!)
done
# Wait until all three hold version 0 (registered and joined).
for _ in $(seq 1 600); do
  n=$($dcr status --store "$store" --json | python3 -c \
    'import json,sys; print(sum(1 for r in json.load(sys.stdin)["receivers"] if r["live"] and r["state"]=="following"))')
  [ "$n" = 3 ] && break
  sleep 0.2
done

echo
echo "== publish versions 1..$versions; each returns once every receiver has applied, verified and acked it"
for v in $(seq 1 "$versions"); do
  $dcr publish --store "$store" --version "$v" --json "$out/gen/v$v" > "$out/publish-v$v.json"
done
for p in "${pids[@]}"; do wait "$p"; done
pids=()

echo
echo "== the same link, full copies: upload version $versions once, three receivers download it at once"
t0=$(date +%s.%N)
for f in "$out/gen/v$versions"/*; do $dcr store put "$store" "full/$(basename "$f")" "$f"; done
t1=$(date +%s.%N)
mkdir -p "$out/full"
dl=()
for i in 1 2 3; do
  (mkdir -p "$out/full/$i" && for f in "$out/gen/v$versions"/*; do
     $dcr store get "$store" "full/$(basename "$f")" "$out/full/$i/$(basename "$f")"; done) &
  dl+=($!)
done
for p in "${dl[@]}"; do wait "$p"; done
t2=$(date +%s.%N)
rm -rf "$out/full"

echo
python3 - "$out" "$versions" "$total" "$elements" "$t0" "$t1" "$t2" <<'EOF'
import json, sys
out, versions, total, elements = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t0, t1, t2 = map(float, sys.argv[5:8])
full = t2 - t0
print(f"full copy of {total / 1e9:.2f} GB through the store: upload {t1 - t0:.2f} s + 3 parallel downloads {t2 - t1:.2f} s = {full:.2f} s")
print()
print(f"{'version':>7} {'attempt':>14} {'changed':>8} {'frame bytes':>12} {'B/changed':>9} {'bytes vs full':>13} "
      f"{'refit s':>8} {'full copy s':>11} {'speedup':>8}")
for v in range(1, versions + 1):
    r = json.load(open(f"{out}/publish-v{v}.json"))
    changed = r["changed_words"]
    print(f"{v:>7} {r['attempt']:>14} {100.0 * changed / elements:>7.2f}% {r['frame_bytes']:>12,} "
          f"{r['frame_bytes'] / max(changed, 1):>9.3f} {total / max(r['frame_bytes'], 1):>12.1f}x "
          f"{r['total_seconds']:>8.2f} {full:>11.2f} {full / r['total_seconds']:>7.1f}x")
print("\nrefit s: from the publish call to the commit, with all 3 receivers applied, verified (digest) and acked")
EOF

echo
echo "== every receiver against version $versions, byte for byte"
for i in 1 2 3; do
  $dcr diff --summary "$out/receiver-$i" "$out/gen/v$versions" | tail -1
  for f in "$out/gen/v$versions"/*.safetensors; do cmp "$f" "$out/receiver-$i/$(basename "$f")"; done
done
echo "demo: all three receivers hold exactly the bits of version $versions"
state=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["state_dir"])' "$out/publish-v$versions.json")
rm -rf "$state"
echo "(the publisher's baseline, kept in memory at $state between publishes, is removed)"
