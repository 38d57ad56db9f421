#!/usr/bin/env python3
"""Checks that the modules under src/ depend on each other only along the data
path (docs/architecture.md), and that their includes say the same as their
CMake dependencies.

- ORDER is the data path: a module may depend (DEPS in src/<m>/CMakeLists.txt)
  only on modules before it. SIDE modules (test data, generators) may depend on
  anything before them, and no data-path module may depend on them.
- Every `#include "dcr/<h>"` in a module's sources and in the public headers it
  owns must name a header of that module or of one it depends on (directly or
  through others), so that the include graph is the CMake graph.

Exits 1 and names each offending edge. Run by scripts/test.sh.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["base", "format", "delta", "store", "layout", "protocol", "receiver", "relay"]
SIDE = ["synth", "families"]
# The module each public header belongs to (its implementation lives there).
OWNER = {
    "status.h": "base", "hash.h": "base", "mapped_file.h": "base", "progress.h": "base", "thread_pool.h": "base",
    "text.h": "base", "clock.h": "base", "metrics.h": "base", "cpu.h": "base",
    "dtype.h": "format", "safetensors.h": "format", "checkpoint.h": "format", "json.h": "format",
    "digest.h": "delta", "frame.h": "delta", "chunk_codec.h": "delta", "compare.h": "delta", "delta.h": "delta",
    "apply.h": "delta",
    "store.h": "store", "http.h": "store", "s3.h": "store",
    "layout.h": "layout", "layout_apply.h": "layout", "layout_residual.h": "layout", "fp8_engine.h": "layout", "contribution.h": "layout",
    "run_keys.h": "protocol", "run_records.h": "protocol", "signing.h": "protocol", "publisher.h": "protocol",
    "shard_publisher.h": "protocol", "run_status.h": "protocol",
    "frame_transport.h": "protocol",
    "receiver.h": "receiver",
    "relay.h": "relay",
    "synth.h": "synth",
    "layout_families.h": "families",
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"dcr/([^"]+)"', re.M)


def cmake_deps(module: str) -> set[str]:
    text = (ROOT / "src" / module / "CMakeLists.txt").read_text()
    m = re.search(r"dcr_module\(\s*\w+(.*?)\)", text, re.S)
    deps = re.search(r"DEPS(.*)", m.group(1), re.S) if m else None
    return set(re.findall(r"\bdcr_(\w+)", deps.group(1))) if deps else set()


def main() -> int:
    modules = ORDER + SIDE
    errors = []
    found = {p.name for p in (ROOT / "src").iterdir() if (p / "CMakeLists.txt").exists()}
    if found != set(modules):
        errors.append(f"src/ modules {sorted(found)} are not the ones this script knows {sorted(modules)}")
    headers = {p.name for p in (ROOT / "include" / "dcr").glob("*.h")}
    if headers != set(OWNER):
        errors.append(f"public headers without an owner here: {sorted(headers - set(OWNER))}; "
                      f"owners of missing headers: {sorted(set(OWNER) - headers)}")
    deps = {m: cmake_deps(m) for m in modules if m in found}
    for m, ds in deps.items():
        for d in ds:
            if d not in modules:
                errors.append(f"{m} depends on unknown module {d}")
            elif d in SIDE and m in ORDER:
                errors.append(f"{m} (data path) depends on {d}, a test-data module")
            elif modules.index(d) >= modules.index(m) and not (m in SIDE and d in ORDER):
                errors.append(f"{m} depends on {d}, which comes after it on the data path")
    closure = {}
    for m in modules:
        seen, todo = set(), [m]
        while todo:
            for d in deps.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        closure[m] = seen | {m}
    sources = {m: [p for p in (ROOT / "src" / m).glob("*") if p.suffix in (".cc", ".h") and
                   not p.stem.endswith("_test") and not p.name.startswith("test_")] for m in deps}
    for h, m in OWNER.items():
        if (ROOT / "include" / "dcr" / h).exists():
            sources.setdefault(m, []).append(ROOT / "include" / "dcr" / h)
    for m, files in sources.items():
        for f in files:
            for h in INCLUDE.findall(f.read_text(errors="replace")):
                owner = OWNER.get(h)
                if owner is None:
                    errors.append(f"{f.relative_to(ROOT)} includes dcr/{h}, which has no owner here")
                elif owner not in closure[m]:
                    errors.append(f"{f.relative_to(ROOT)} ({m}) includes dcr/{h} of {owner}, not among its dependencies")
    for e in errors:
        print("check_includes:", e, file=sys.stderr)
    if not errors:
        print(f"check_includes: {len(modules)} modules along the data path, every include follows the dependencies")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
