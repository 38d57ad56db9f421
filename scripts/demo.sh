#!/usr/bin/env bash
# The main job on the embedded default: builds dcr, generates a
# Qwen3-MoE-like checkpoint and two versions of a training run, and shows
# what changed between them, bit for bit.
# (This grows into a full refit through the local directory store.)
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
dcr=build/tools/dcr/dcr
out=${DCR_DEMO_DIR:-out/demo}

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
echo "== dcr diff $out/v1 $out/v1 (identical: exit 0)"
$dcr diff --summary "$out/v1" "$out/v1"
