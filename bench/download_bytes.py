#!/usr/bin/env python3
"""What a receiver downloads per version, against the payload (issue 25).

    bench/download_bytes.py [--dcr build/tools/dcr/dcr] [--old OLD_DCR]
                            [--sizes 64MB,2GB] [--rates 0.001,0.01,0.03] [--dir /dev/shm/dcr-download-bytes]

For each checkpoint size and change rate it generates v0 and v1 (`dcr gen`, the
training model, a qwen3-moe checkpoint with hundreds of tensors), publishes both into
a fresh file store with each dcr binary given (`dcr publish --json`), and prints the
bytes a receiver downloads for version 1 (attempt.json, the frame objects with their
trailers, the manifest, the commit record; docs/format.md, section 4) against the
payload, each binary on the same inputs in the same run. `--old` is a dcr built from
an earlier commit (format version 1: JSON manifests, 96-byte frame headers), e.g.

    git worktree add /tmp/old-dcr 4e2d6c4
    cmake -S /tmp/old-dcr -B /tmp/old-dcr/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DDCR_BUILD_TESTS=OFF && cmake --build /tmp/old-dcr/build --target dcr

Targets (issue 25): at most 1.03x the payload at 1% and 3%, 1.15x at 0.1%.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def run_json(cmd: list) -> dict:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{r.stderr}")
    out = r.stdout
    return json.loads(out[out.index("{"):out.rindex("}") + 1])


def publish(dcr: str, gen: Path, work: Path) -> dict:
    """Version 1's report, published after version 0 into a fresh store."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store, state = work / "store", work / "state"
    for v in (0, 1):
        report = run_json([dcr, "publish", "--store", store, "--state", state, "--version", v, gen / f"v{v}",
                           "--json"])
    shutil.rmtree(work, ignore_errors=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcr", default="build/tools/dcr/dcr")
    ap.add_argument("--old", help="a dcr of the previous format, measured on the same inputs")
    ap.add_argument("--sizes", default="64MB,2GB")
    ap.add_argument("--rates", default="0.001,0.01,0.03")
    ap.add_argument("--dir", default="/dev/shm/dcr-download-bytes")
    a = ap.parse_args()
    root = Path(a.dir)
    binaries = [("new", a.dcr)] + ([("old", a.old)] if a.old else [])
    rows = []
    for size in a.sizes.split(","):
        for rate in a.rates.split(","):
            gen = root / f"gen-{size}-{rate}"
            t0 = time.monotonic()
            shutil.rmtree(gen, ignore_errors=True)
            subprocess.run([a.dcr, "gen", "-o", gen, "--size", size, "--rate", rate, "--versions", "1"], check=True,
                           capture_output=True)
            row = {"size": size, "rate": float(rate)}
            for name, dcr in binaries:
                r = publish(dcr, gen, root / "work")
                row[name] = {k: r[k] for k in ("payload_bytes", "frame_bytes", "manifest_bytes", "download_bytes",
                                               "changed_words")}
            shutil.rmtree(gen, ignore_errors=True)
            rows.append(row)
            n = row["new"]
            print(f"{size} at {float(rate):.1%}: payload {n['payload_bytes']:,} B, a receiver downloads "
                  f"{n['download_bytes']:,} B ({n['download_bytes'] / n['payload_bytes']:.3f}x)"
                  + (f"; the old format {row['old']['download_bytes']:,} B "
                     f"({row['old']['download_bytes'] / row['old']['payload_bytes']:.3f}x)" if a.old else "")
                  + f" [{time.monotonic() - t0:.0f} s]", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    print()
    head = "| checkpoint | changed | payload B | manifest B | frame headers B | downloaded B | downloaded / payload |"
    if a.old:
        head += " old format: downloaded B | old / payload |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        n = row["new"]
        line = (f"| {row['size']} | {row['rate']:.1%} | {n['payload_bytes']:,} | {n['manifest_bytes']:,} | "
                f"{n['frame_bytes'] - n['payload_bytes']:,} | {n['download_bytes']:,} | "
                f"{n['download_bytes'] / n['payload_bytes']:.3f} |")
        if a.old:
            o = row["old"]
            line += f" {o['download_bytes']:,} | {o['download_bytes'] / o['payload_bytes']:.3f} |"
        print(line)


if __name__ == "__main__":
    main()
