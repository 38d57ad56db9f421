#!/usr/bin/env python3
"""Relay tree benchmark (issue 6): refit completion time against the number of
receivers and the fanout, with every link paced to LINK MB/s by the
in-process throttle (`dcr relay --link-mbps`, `dcr publish --relay-mbps`),
next to
  (a) every receiver downloading the frames from the store, the store's
      egress (the cross-cluster link) shared fairly: each receiver's store
      is paced to LINK / N MB/s (DCR_STORE_FAULTS=mbps=...), and
  (b) the full checkpoint through the same tree: version 1 is an unrelated
      checkpoint of the same shapes (another seed), so the frames carry about
      the checkpoint's size.
Time is `dcr publish` of version 1 from start to commit (the commit needs
every receiver's ack), so it includes encoding and the protocol's polling.
The bound printed beside it: payload / link + depth x segment / link.

  bench/relay_bench.py [--dcr build/tools/dcr/dcr] [--link 2] [--size 32MB] [--receivers 1,2,4,8,16] [--fanouts 2,4]
                       [--tc]

--tc (root; iproute2): instead of the in-process throttle, every process of
the tree (the sender, each relay, each receiver) runs in its own network
namespace, all attached to one bridge in a hub namespace, and each node's
downlink (the hub side of its veth) is shaped with `tc qdisc ... tbf` to LINK
MB/s. Every node has one upstream peer, so each link of the tree is shaped
once, as with the throttle; a relay's outgoing links do not share its
uplink. The store rows keep the in-process store pacing (the file store is
not a network path).

"apply tail" is the slowest receiver's time from having the manifest and every
frame object to its ack (`dcr follow`'s "applied ... s after" line).

Relays: ceil(receivers / 2), two receivers each, one cluster. The pacing is
per link and in-process (a token-less "next send" clock per child / root);
it models link bandwidth, not latency or loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import Net  # noqa: E402

SEGMENT = 256 << 10


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def env(extra=None) -> dict:
    e = dict(os.environ)
    e["DCR_PROGRESS"] = "0"
    for k in ("DCR_STORE_FAULTS", "DCR_TEST_CRASH_AT", "DCR_STATE_DIR"):
        e.pop(k, None)
    e.update(extra or {})
    return e


def run(dcr, *args, **kw):
    p = subprocess.run([dcr, *map(str, args)], capture_output=True, text=True, env=env(), **kw)
    if p.returncode != 0:
        raise SystemExit(f"dcr {' '.join(map(str, args))} failed:\n{p.stderr}")
    return p.stdout


def apply_tail(logs: list[Path]) -> float:
    """The slowest receiver's seconds from having everything to its ack."""
    tail = 0.0
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if "applied version 1 " in line and " s after the manifest" in line:
                tail = max(tail, float(line.split("(", 1)[1].split(" ", 1)[0]))
    return tail


def one(dcr: str, work: Path, v0: Path, v1: Path, receivers: int, fanout: int | None, link: float,
        use_tc: bool = False) -> dict:
    """One refit from v0 to v1 for `receivers`; through a tree of
    ceil(receivers / 2) relays with `fanout`, or from the store when None."""
    root = Path(tempfile.mkdtemp(dir=work))
    store = f"file://{root / 'store'}"
    procs = []
    net = Net(link) if use_tc and fanout is not None else None
    where: dict[str, str] = {}  # node name -> namespace (tc)
    try:
        run(dcr, "publish", "--store", store, "--version", 0, "--state", root / "state", v0)
        plan = None
        if fanout is not None:
            n_relays = max(1, math.ceil(receivers / 2))
            listing = []
            for i in range(n_relays):
                address = free_address()
                if net:
                    where[f"r{i:02}"], ip = net.node(f"r{i:02}")
                    address = f"tcp://{ip}:7400"
                listing.append({"id": f"r{i:02}", "address": address, "cluster": "rollout"})
            (root / "relays.json").write_text(json.dumps(listing))
            plan = json.loads(run(dcr, "relay", "plan", "--relays", root / "relays.json", "--fanout", fanout))
            for n in plan["relays"]:
                # Local links: plain TCP, said explicitly (relays are CURVE by default).
                args = [dcr, "relay", "--id", n["id"], "--listen", n["address"], "--insecure"]
                if not net:
                    args += ["--link-mbps", link]
                for up in n["upstream"]:
                    args += ["--parent", up]
                if net:
                    args = net.wrap(where[n["id"]], args)
                procs.append(subprocess.Popen(list(map(str, args)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env()))
        # Join first (the snapshot from an unpaced store), so that only the
        # refit goes through the paced links.
        joins = [subprocess.Popen([dcr, "follow", "--store", store, "--id", f"e{i:02}", "--until", "0",
                                   str(root / f"t{i:02}")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=env()) for i in range(receivers)]
        for j in joins:
            if j.wait(timeout=300) != 0:
                raise SystemExit("a receiver could not join")
        followers, logs = [], []
        for i in range(receivers):
            args = [dcr, "follow", "--store", store, "--id", f"e{i:02}", "--poll", "0.02", "--heartbeat", "0.2",
                    "--until", 1, root / f"t{i:02}"]
            e = {}
            if plan:
                n = plan["relays"][i // 2]
                for addr in [n["address"], *n["upstream"]]:
                    args += ["--relay", addr]
                args += ["--relay-insecure"]
            else:
                e["DCR_STORE_FAULTS"] = f"mbps={link / receivers}"
            if net:
                where[f"e{i:02}"], _ = net.node(f"e{i:02}")
                args = net.wrap(where[f"e{i:02}"], args)
            logs.append(root / f"follow-e{i:02}.log")
            with open(logs[-1], "wb") as out:
                followers.append(subprocess.Popen(list(map(str, args)), stdout=out, stderr=subprocess.STDOUT,
                                                  env=env(e)))
        procs += followers
        deadline = time.monotonic() + 120
        while True:  # every receiver registered and following
            recs = [root / "store" / "receivers" / f"e{i:02}.json" for i in range(receivers)]
            if all(r.exists() and json.loads(r.read_text()).get("state") == "following" for r in recs):
                break
            if time.monotonic() > deadline:
                raise SystemExit("receivers did not start")
            time.sleep(0.05)
        time.sleep(1.0)  # relay clients attached (pings every 0.25 s)
        args = ["publish", "--store", store, "--version", 1, "--state", root / "state", "--segment", SEGMENT,
                "--json", v1]
        if plan:
            args[1:1] = ["--relay", plan["relays"][0]["address"], "--relay-insecure"] + \
                ([] if net else ["--relay-mbps", link])
        command = [dcr, *args]
        if net:
            pub_ns, _ = net.node("pub")
            command = net.wrap(pub_ns, command)
        start = time.monotonic()
        p = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=env(), timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"publish failed:\n{p.stderr}")
        report = json.loads(p.stdout)
        seconds = time.monotonic() - start
        for f in followers:
            f.wait(timeout=120)
        depth = plan["depth"] + 1 if plan else 1  # links on the way: sender -> root -> ... -> receiver
        bound = report["frame_bytes"] / (link * 1e6) + depth * SEGMENT / (link * 1e6)
        return {"seconds": seconds, "frame_bytes": report["frame_bytes"], "bound": bound, "depth": depth,
                "tail": apply_tail(logs)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if net:
            net.close()
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dcr", default="build/tools/dcr/dcr")
    ap.add_argument("--link", type=float, default=2.0, help="MB/s per link")
    ap.add_argument("--size", default="32MB")
    ap.add_argument("--receivers", default="1,2,4,8,16")
    ap.add_argument("--fanouts", default="2,4")
    ap.add_argument("--tc", action="store_true", help="shape links with network namespaces and tc tbf (root)")
    a = ap.parse_args()
    if a.tc and (os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc")):
        raise SystemExit("--tc needs root and iproute2 (ip, tc): apt-get install iproute2")
    dcr = str(Path(a.dcr).resolve())
    work = Path(tempfile.mkdtemp(prefix="dcr-relay-bench-"))
    try:
        gen = work / "gen"
        run(dcr, "gen", "-o", gen, "--family", "qwen3-moe", "--size", a.size, "--versions", 1, "--update", "stress",
            "--rate", "0.03", "--seed", 5)
        # The full checkpoint through the tree: version 1 is an unrelated
        # checkpoint of the same shapes (another seed), so every chunk's
        # frame is about as large as the chunk.
        full = work / "full"
        run(dcr, "gen", "-o", full, "--family", "qwen3-moe", "--size", a.size, "--versions", 1, "--seed", 6)
        print(f"links {'shaped by tc tbf' if a.tc else 'paced'} to {a.link} MB/s; model {a.size} (qwen3-moe), 3% of "
              f"elements changed (stress); segments {SEGMENT >> 10} KiB")
        print(f"{'receivers':>9} {'how':>22} {'frames':>10} {'seconds':>8} {'bound s':>8} {'ratio':>6} {'apply tail':>10}")
        for n in [int(x) for x in a.receivers.split(",")]:
            rows = [("store (shared link)", one(dcr, work, gen / "v0", gen / "v1", n, None, a.link))]
            for f in [int(x) for x in a.fanouts.split(",")]:
                rows.append((f"tree fanout {f}", one(dcr, work, gen / "v0", gen / "v1", n, f, a.link, a.tc)))
            rows.append(("full ckpt, tree fanout 2", one(dcr, work, gen / "v0", full / "v0", n, 2, a.link, a.tc)))
            for how, r in rows:
                print(f"{n:>9} {how:>22} {r['frame_bytes']:>10} {r['seconds']:>8.2f} {r['bound']:>8.2f} "
                      f"{r['seconds'] / r['bound']:>6.2f} {r['tail']:>10.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
