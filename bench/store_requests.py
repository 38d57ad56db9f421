#!/usr/bin/env python3
"""Requests a run makes against S3, counted by the S3 server itself.

What an object store bills and throttles is requests: per-prefix limits of
about 5,500 GET/s and 3,500 PUT/LIST/s (REFERENCE.md), and list prices of
$0.0004 per 1,000 GETs and $0.005 per 1,000 PUT/LIST requests. This counts
them on the tests' radosgw (tests/s3/radosgw.sh), from its own counters
(`perf dump`: rgw.req, rgw.get, rgw.put), for one publisher and R `dcr
follow` receivers of a generated 64 MB qwen3-moe checkpoint:

  store   receivers poll the store (the baseline: every receiver, every mode)
  tree    receivers attached to a relay root that the publisher pushes to: the
          tree carries frames and the coordinator's notices (docs/relay.md)

For each: the requests per second per receiver while nothing is published
(what R receivers cost between training steps), and the requests of the
whole run per version (the publisher's and every receiver's).

  bench/store_requests.py [--receivers 8] [--versions 4] [--idle 10] [--segment 16KB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DCR = os.environ.get("DCR", str(ROOT / "build/tools/dcr/dcr"))
sys.path.insert(0, str(ROOT / "bench" / "scale"))
from validate import env, receiver_state  # noqa: E402
from validate import run as run_dcr  # noqa: E402


def run(*args) -> str:
    return run_dcr(DCR, *args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rgw:
    """The tests' radosgw, and its request counters."""

    def __init__(self, work: Path):
        self.dir = work / "rgw"
        p = subprocess.run([str(ROOT / "tests/s3/radosgw.sh"), "start", str(self.dir)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            raise SystemExit(f"radosgw did not start:\n{p.stderr[-3000:]}")
        self.env = dict(line.split("=", 1) for line in (self.dir / "env").read_text().splitlines() if "=" in line)
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("AWS_")})

    def url(self, prefix: str) -> str:
        return (f"s3://dcr-requests/{prefix}?endpoint={self.env['DCR_S3_ENDPOINT']}&addressing=path"
                f"&create_bucket=1&region={self.env['AWS_REGION']}")

    def counters(self) -> dict:
        p = subprocess.run(["ceph", "-c", str(self.dir / "ceph.conf"), "daemon", str(self.dir / "run/client.rgw.asok"),
                            "perf", "dump"], capture_output=True, text=True, check=True)
        r = json.loads(p.stdout)["rgw"]
        return {"req": r["req"], "get": r["get"], "put": r["put"]}

    def stop(self):
        subprocess.run([str(ROOT / "tests/s3/radosgw.sh"), "stop", str(self.dir)], capture_output=True)


def delta(a: dict, b: dict) -> dict:
    d = {k: b[k] - a[k] for k in a}
    d["other"] = d["req"] - d["get"] - d["put"]  # listings, HEADs, deletes, requests of missing keys
    return d


def one_mode(rgw: Rgw, gen: Path, work: Path, mode: str, receivers: int, versions: int, idle: float,
             segment: str) -> dict:
    store = rgw.url(f"{mode}-{int(time.time())}")
    procs = []
    try:
        run("publish", "--store", store, "--version", 0, "--state", work / f"{mode}-state", gen / "v0")
        relay_args, publish_args = [], ["--segment", segment] if segment else []
        if mode == "tree":
            addr = f"tcp://127.0.0.1:{free_port()}"
            procs.append(subprocess.Popen([DCR, "relay", "--id", "root", "--listen", addr, "--insecure", "--store",
                                           store], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env()))
            relay_args = ["--relay", addr, "--relay-insecure"]
            publish_args += ["--relay", addr, "--relay-insecure"]
        for i in range(receivers):
            procs.append(subprocess.Popen([DCR, "follow", "--store", store, "--id", f"e{i:02}", "--until", str(versions),
                                           *relay_args, work / f"{mode}-t{i:02}"], stdout=subprocess.DEVNULL,
                                          stderr=open(work / f"{mode}-e{i:02}.log", "w"), env=env()))
        deadline = time.monotonic() + 120
        while receivers and not all(receiver_state(DCR, store, f"e{i:02}") == "following" for i in range(receivers)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{mode}: receivers did not start")
            time.sleep(0.2)
        # The first version lets every receiver attach and hear a notice.
        run("publish", "--store", store, "--version", 1, "--state", work / f"{mode}-state", *publish_args, gen / "v1")
        time.sleep(1.0)
        a = rgw.counters()
        t0 = time.monotonic()
        time.sleep(idle)
        b = rgw.counters()
        idle_rates = {k: v / (time.monotonic() - t0) / max(receivers, 1) for k, v in delta(a, b).items()}
        print(f"  {mode}: idle {idle_rates['req']:.2f} requests/s" + (" per receiver" if receivers else ""), flush=True)
        per_version = []
        for v in range(2, versions + 1):
            a = rgw.counters()
            t0 = time.monotonic()
            run("publish", "--store", store, "--version", v, "--state", work / f"{mode}-state", *publish_args,
                gen / f"v{v}")
            seconds = time.monotonic() - t0
            time.sleep(0.5)  # the receivers see the commit
            d = delta(a, rgw.counters())
            d["seconds"] = seconds
            d["window"] = time.monotonic() - t0
            d["objects"] = sum("/frames/" in line for line in run("store", "ls", store, f"attempts/v{v:010}/").splitlines())
            per_version.append(d)
            print(f"  {mode}: v{v} {d['req']} requests ({seconds:.2f} s, {d['objects']} frame objects)", flush=True)
        for i, p in enumerate(procs[len(procs) - receivers:]):
            if p.wait(timeout=120) != 0:
                raise SystemExit(f"{mode}: receiver e{i:02} failed: {(work / f'{mode}-e{i:02}.log').read_text()[-2000:]}")
        for i in range(receivers):
            run("diff", work / f"{mode}-t{i:02}", gen / f"v{versions}")
        return {"idle": idle_rates, "versions": per_version}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)


# The reference testbed's refits at 3% (docs/scale.md, "Projections"): seconds, frame objects of 16 MiB.
REFITS = {"120B": (1.8, 248), "1T": (13.4, 2072)}
PAGE = 1000  # keys per listing page (S3's ListObjectsV2)


def projected(mode: str, seconds: float, objects: int, records: float) -> dict:
    """A receiver's requests per second: idle, and while a refit of `seconds` with `objects` frame objects
    streams, from dcr follow's defaults (--poll 0.1, --stream-poll 0.02, --relay-poll 1, --heartbeat 1).
    A look is a GET of the next commit and a listing of the version's attempts, in pages of PAGE keys;
    `records` are the per-version reads and writes measured above (attempt.json, manifest, ack, state)."""
    pages = 1 + objects // PAGE
    if mode == "store":
        idle = (1 + 1) / 0.1 + 1
        refit = (1 + pages) / 0.02 + 1 + (objects + records) / seconds
    else:
        idle = (1 + 1) / 1.0 + 1
        refit = (1 + pages) / 1.0 + 1 + (3 * (1 + pages) + records) / seconds
    return {"idle": idle, "refit": refit}


def print_projection(records: float) -> None:
    print("\nprojected per receiver (requests/s) and receivers that reach S3's ~5,500 requests/s per prefix:\n")
    print("| refit (reference testbed, 3%) | receivers | idle | during the refit | receivers at 5,500/s: idle | "
          "receivers at 5,500/s: refit |")
    print("|---|---|---|---|---|---|")
    for name, (seconds, objects) in REFITS.items():
        for mode in ("store", "tree"):
            p = projected(mode, seconds, objects, records)
            print(f"| {name}: {seconds} s, {objects} objects | {mode} | {p['idle']:.0f} | {p['refit']:.0f} | "
                  f"{5500 / p['idle']:.0f} | {5500 / p['refit']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--receivers", type=int, default=8)
    ap.add_argument("--versions", type=int, default=4, help="versions after v0 (v1 warms up; the rest are counted)")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle following counted")
    ap.add_argument("--segment", default="", help="dcr publish --segment (default: dcr's): smaller, more objects")
    a = ap.parse_args()
    if a.versions < 2:
        raise SystemExit("--versions must be at least 2")
    work = Path(tempfile.mkdtemp(prefix="dcr-requests-"))
    rgw = None
    try:
        gen = work / "gen"
        print(f"generating a 64 MB checkpoint and {a.versions} versions", flush=True)
        run("gen", "-o", gen, "--family", "qwen3-moe", "--size", "64MB", "--versions", a.versions, "--seed", 5)
        print("starting radosgw", flush=True)
        rgw = Rgw(work)
        results = {}
        print("publisher alone (no receivers): its own requests", flush=True)
        alone = one_mode(rgw, gen, work, "alone", 0, a.versions, a.idle, a.segment)
        for mode in ("store", "tree"):
            print(f"{mode}: one publisher, {a.receivers} receivers", flush=True)
            results[mode] = one_mode(rgw, gen, work, mode, a.receivers, a.versions, a.idle, a.segment)
        n = a.versions - 1
        mean = lambda r, k: sum(v[k] for v in r["versions"]) / n  # noqa: E731
        print(f"\nrequests counted by radosgw; per version: the mean of v2..v{a.versions} over the publish and 0.5 s "
              f"after, less the publisher's own ({mean(alone, 'req'):.0f} with no receiver), per receiver "
              f"({a.receivers}), less idle following in the same time\n")
        print("| receivers | idle: requests/s per receiver (GET / PUT / list+other) | idle vs store | "
              "a version adds per receiver (GET / PUT / list+other) | per version vs store | refit s | frame objects |")
        print("|---|---|---|---|---|---|---|")
        # What a version adds per receiver: less the publisher's own, less what idle following costs in the
        # same window (the publish and 0.5 s after it).
        per = {m: {k: (mean(r, k) - mean(alone, k)) / a.receivers - r["idle"][k] * mean(r, "window")
                   for k in ("req", "get", "put", "other")} for m, r in results.items()}
        for mode, r in results.items():
            i, p = r["idle"], per[mode]
            print(f"| {mode} | {i['req']:.2f} ({i['get']:.2f} / {i['put']:.2f} / {i['other']:.2f}) | "
                  f"{i['req'] / results['store']['idle']['req']:.2f} | {p['req']:.1f} ({p['get']:.1f} / "
                  f"{p['put']:.1f} / {p['other']:.1f}) | {p['req'] / per['store']['req']:.2f} | "
                  f"{mean(r, 'seconds'):.2f} | {mean(r, 'objects'):.0f} |")
        results["alone"] = alone
        # The records a receiver reads and writes per version are the same in both modes; the tree's figure
        # has no frame object downloads in it.
        print_projection(per["tree"]["get"] + per["tree"]["put"])
        print("\n" + json.dumps(results))
    finally:
        if rgw:
            rgw.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
