#!/usr/bin/env bash
# The main job on the embedded default (local files): builds dcr, generates
# a Qwen3-MoE-like checkpoint and two steps of a simulated training run,
# shows what changed bit for bit, then moves a receiver from v0 to v2 by
# deltas alone and proves it ends byte-identical to the full checkpoint.
# (This grows into a full refit through the local directory store.)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
dcr=build/tools/dcr/dcr
out=${DCR_DEMO_DIR:-out/demo}
rm -rf "$out"

echo "== dcr gen: version 0 and two training steps of a ~256 MB Qwen3-MoE-like model"
$dcr gen -o "$out" --family qwen3-moe --size 256MB --versions 2 --update training --rate 0.02 --seed 42
echo
echo "== dcr inspect $out/v0 (totals)"
$dcr inspect "$out/v0" | sed -n '/ tensors, /,$p'
echo
echo "== dcr diff $out/v0 $out/v1"
set +e
$dcr diff --summary "$out/v0" "$out/v1"
rc=$?
set -e
[ "$rc" = 1 ] || { echo "demo: expected the versions to differ (exit 1), got $rc" >&2; exit 1; }

echo
echo "== a receiver holding v0 follows v1 and v2 by deltas"
cp -r "$out/v0" "$out/receiver"
for v in 1 2; do
  $dcr delta make "$out/v$((v - 1))" "$out/v$v" -o "$out/delta-v$v"
  $dcr delta apply "$out/receiver" "$out/delta-v$v"
done
echo
echo "== dcr diff $out/receiver $out/v2 (must be identical: exit 0)"
$dcr diff --summary "$out/receiver" "$out/v2"
