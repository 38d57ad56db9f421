#!/usr/bin/env python3
"""Validate the scale model (model.py) against real refits on this machine.

Each configuration is a real run: P trainer processes (`dcr publish --process p/P`,
Megatron pipeline x expert parallel shards of one synthetic model, LAYOUTS) and R
receivers (`dcr follow`), every process in its own network namespace (netlab.py).
Each trainer node's uplink (its cross-cluster link) is shaped with tc tbf; every
node of the rollout cluster (relays, receivers) has both directions shaped to the
in-cluster rate. Frames go through a relay tree (`dcr relay plan`, a relay per two
receivers), the records through a file store in memory; or everything through a
real S3 (the tests' radosgw, listening on the namespaces' bridge).

Per configuration: version 0 is published and every receiver joins it unshaped; v1
warms the trainers' state; v2..vN are timed: the coordinator's `dcr publish` from
start to commit, which waits for every receiver's ack (applied and verified). The
receivers end byte-identical to the last version (checked).

The model's parameters come from the CALIBRATION runs in the same invocation, none
of them a validated configuration: CPU seconds per version by role (the kernel's
accounting of each process), idle polling, a link's efficiency, S3's time per
object, the fixed cost. Then each configuration's median is set beside the model.

  sudo bench/scale/validate.py [--dcr build/tools/dcr/dcr] [--size 256MB] [--versions 4]
                               [--out docs/scale] [--quick] [--no-s3]

Needs root and iproute2 (ip, tc); writes docs/scale/validation.json
(bench/scale/project.py draws it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from model import Config, Params, predict, request_rounds  # noqa: E402
from netlab import Net  # noqa: E402

SEGMENT = 256 << 10
MB = 1e6


def env() -> dict:
    e = dict(os.environ)
    e["DCR_PROGRESS"] = "0"
    for k in ("DCR_STORE_FAULTS", "DCR_TEST_CRASH_AT", "DCR_STATE_DIR"):
        e.pop(k, None)
    return e


def run(dcr, *args) -> str:
    p = subprocess.run([dcr, *map(str, args)], capture_output=True, text=True, env=env())
    if p.returncode != 0:
        raise SystemExit(f"dcr {' '.join(map(str, args))} failed:\n{p.stderr[-3000:]}")
    return p.stdout


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (ip netns exec execs its command: same pid)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Trainer processes -> Megatron (pipeline, expert) parallel sizes, one sender each.
# The synthetic model's two KV heads rule out tensor parallel beyond 2.
LAYOUTS = {1: (1, 1), 2: (2, 1), 4: (4, 1), 8: (2, 4)}


class Inputs:
    """A synthetic model's versions and, per trainer count, every sender's map and
    shard files of every version (LAYOUTS)."""

    def __init__(self, dcr: str, work: Path, size: str, versions: int):
        self.dcr, self.work, self.size, self.versions = dcr, work, size, versions
        self.gen = work / "gen"
        run(dcr, "gen", "-o", self.gen, "--family", "qwen3-moe", "--size", size, "--versions", versions, "--update",
            "training", "--rate", "0.03", "--seed", 11)
        self.dense = sum(f.stat().st_size for f in (self.gen / "v0").iterdir() if f.suffix == ".safetensors")
        self.shards: dict[int, list[str]] = {}

    def senders(self, p: int) -> list[str]:
        """Maps of the p senders; their shards of version v in shards-p<p>/v<v>/s<k>."""
        if p not in self.shards:
            maps = []
            pp, ep = LAYOUTS[p]
            for k in range(p):
                m = self.work / f"map-p{p}-s{k}.json"
                run(self.dcr, "layout", "generate", "--side", "megatron", "--family", "qwen3-moe", "--size",
                    self.size, "--pp", pp, "--ep", ep, "--pp-rank", k // ep, "--ep-rank", k % ep, "-o", m)
                maps.append(str(m))
                for v in range(self.versions + 1):
                    run(self.dcr, "layout", "load", self.gen / f"v{v}", m, "-o",
                        self.work / f"shards-p{p}" / f"v{v}" / f"s{k}")
            self.shards[p] = maps
        return self.shards[p]


class Procs:
    def __init__(self):
        self.all: list[subprocess.Popen] = []

    def start(self, args, log: Path | None = None) -> subprocess.Popen:
        out = open(log, "wb") if log else subprocess.DEVNULL
        p = subprocess.Popen(list(map(str, args)), stdout=out, stderr=subprocess.STDOUT, env=env())
        self.all.append(p)
        return p

    def stop(self):
        for p in self.all:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.all:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def receiver_state(dcr: str, store: str, receiver: str) -> str:
    """A receiver's state from its record; empty while there is none (or it is
    being replaced)."""
    p = subprocess.run([dcr, "store", "cat", store, f"receivers/{receiver}.json"], capture_output=True, text=True,
                       env=env())
    try:
        return json.loads(p.stdout).get("state", "") if p.returncode == 0 else ""
    except ValueError:
        return ""


class Lab:
    """What every run shares: the inputs, one set of namespaces on a bridge (this
    machine joined to it, unshaped) and, for S3 runs, a radosgw listening there."""

    HOST = "10.88.255.254"

    def __init__(self, dcr: str, inputs: Inputs):
        self.dcr, self.inputs = dcr, inputs
        self.net = Net(host_address=self.HOST)
        self.runs = 0
        self.s3_dir: Path | None = None
        self.s3_env: dict = {}

    def start_s3(self):
        self.s3_dir = Path(tempfile.mkdtemp(prefix="dcr-scale-rgw-"))
        # Every configuration's run stays in the OSD's memory store until the end.
        e = {**os.environ, "DCR_S3_ALSO_LISTEN": self.HOST, "DCR_S3_MEMSTORE_BYTES": str(6 << 30)}
        p = subprocess.run([str(HERE.parent.parent / "tests/s3/radosgw.sh"), "start", str(self.s3_dir)], env=e,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"radosgw did not start:\n{p.stderr[-3000:]}")
        for line in (self.s3_dir / "env").read_text().splitlines():
            k, _, v = line.partition("=")
            self.s3_env[k] = v
        os.environ.update({k: v for k, v in self.s3_env.items() if k.startswith("AWS_")})

    def s3_cpu(self) -> float:
        """CPU seconds of the Ceph daemons behind radosgw so far."""
        total = 0.0
        for line in (self.s3_dir / "pids").read_text().splitlines():
            try:
                total += cpu_seconds(int(line.split()[1]))
            except (OSError, IndexError, ValueError):
                pass
        return total

    def store_url(self, c: Config, root: Path) -> str:
        if c.transport == "relay":
            return f"file://{root / 'store'}"
        port = self.s3_env["DCR_S3_ENDPOINT"].rsplit(":", 1)[1]
        return (f"s3://dcr-scale/run{self.runs}?endpoint=http://{self.HOST}:{port}&addressing=path&create_bucket=1"
                f"&region={self.s3_env['AWS_REGION']}")

    def close(self):
        self.net.close()
        if self.s3_dir:
            subprocess.run([str(HERE.parent.parent / "tests/s3/radosgw.sh"), "stop", str(self.s3_dir)],
                           capture_output=True)

    def frame_bytes_by_process(self, store: str, v: int, processes: int) -> list[int]:
        """Each trainer process's frame objects of v (frames/s<process>-NNNN.bin)."""
        per = [0] * processes
        for line in run(self.dcr, "store", "ls", store, f"attempts/v{v:010}/").splitlines():
            size, _, key = line.strip().partition(" ")
            name = key.rsplit("/", 1)[-1]
            if "/frames/" in key and name.startswith("s") and name.endswith(".bin"):
                per[int(name[1:].split("-")[0])] += int(size)
        return per

    def one(self, c: Config, shaped: bool) -> dict:
        """Runs configuration `c`; per timed version: seconds, CPU seconds by role, bytes."""
        dcr, inputs, net = self.dcr, self.inputs, self.net
        self.runs += 1
        tag = f"{self.runs}"
        root = Path(tempfile.mkdtemp(dir=inputs.work))
        store = self.store_url(c, root)
        procs, nodes = Procs(), []
        mbps = lambda rate: rate / MB if shaped else None  # noqa: E731

        def node(name, down, up):
            ns, ip = net.node(f"{tag}-{name}", mbps(down) if down else None, mbps(up) if up else None)
            nodes.append(ns)
            return ns, ip
        try:
            run(dcr, "publish", "--store", store, "--version", 0, "--state", root / "v0-state", inputs.gen / "v0")
            joins = [subprocess.Popen([dcr, "follow", "--store", store, "--id", f"e{i:02}", "--until", "0",
                                       str(root / f"t{i:02}")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=env()) for i in range(c.receivers)]
            if any(j.wait(timeout=600) != 0 for j in joins):
                raise SystemExit("a receiver could not join version 0")
            relay_procs, upstream, relay_root = [], {}, None
            if c.transport == "relay":
                # The rollout cluster: a relay per `per_relay` receivers, planned with the fanout.
                listing, where = [], {}
                for i in range(max(1, math.ceil(c.receivers / c.per_relay))):
                    where[f"r{i:02}"], ip = node(f"r{i:02}", c.in_link, c.in_link)
                    listing.append({"id": f"r{i:02}", "address": f"tcp://{ip}:7400", "cluster": "rollout"})
                (root / "relays.json").write_text(json.dumps(listing))
                plan = json.loads(run(dcr, "relay", "plan", "--relays", root / "relays.json", "--fanout", c.fanout))
                for n in plan["relays"]:
                    args = [dcr, "relay", "--id", n["id"], "--listen", n["address"], "--insecure"]
                    for up in n["upstream"]:
                        args += ["--parent", up]
                    relay_procs.append(procs.start(net.wrap(where[n["id"]], args)))
                relay_root = plan["relays"][0]["address"]
                by_id = {n["id"]: n for n in plan["relays"]}
                for i in range(c.receivers):
                    n = by_id[f"r{i // c.per_relay:02}"]
                    upstream[i] = [n["address"], *n["upstream"]]
            followers = []
            for i in range(c.receivers):
                ns, _ = node(f"e{i:02}", c.in_link, c.in_link)
                # Through S3 each poll is a request that the store serves.
                poll = ("0.02", "0.01") if c.transport == "relay" else ("0.25", "0.1")
                args = [dcr, "follow", "--store", store, "--id", f"e{i:02}", "--poll", poll[0], "--stream-poll",
                        poll[1], "--heartbeat", "0.2", "--until", inputs.versions]
                if i in upstream:
                    args += ["--relay-insecure", *[x for addr in upstream[i] for x in ("--relay", addr)]]
                followers.append(procs.start(net.wrap(ns, [*args, root / f"t{i:02}"]), root / f"follow-e{i:02}.log"))
            deadline = time.monotonic() + 120
            while True:  # every receiver registered and following
                states = [receiver_state(dcr, store, f"e{i:02}") for i in range(c.receivers)]
                if all(x == "following" for x in states):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit("receivers did not start")
                time.sleep(0.1)
            idle = self.idle_rates(c, followers) if not shaped else {}
            trainers = [node(f"p{k}", c.in_link if c.transport == "relay" else None, c.cross_link)[0]
                        for k in range(c.trainers)]
            maps = inputs.senders(c.trainers)
            rows = []
            for v in range(1, inputs.versions + 1):
                rows.append(self.version(c, v, store, root, trainers, maps, followers, relay_procs, relay_root))
            for i, f in enumerate(followers):
                if f.wait(timeout=120) != 0:
                    raise SystemExit(f"receiver e{i:02} failed: {(root / f'follow-e{i:02}.log').read_text()[-2000:]}")
            for i in range(c.receivers):
                run(dcr, "diff", root / f"t{i:02}", inputs.gen / f"v{inputs.versions}")
            return {"rows": rows[1:], "idle": idle}  # v1 warms the trainers' baselines
        finally:
            procs.stop()
            for ns in nodes:
                net.drop(ns)
            shutil.rmtree(root, ignore_errors=True)

    def idle_rates(self, c: Config, followers, seconds: float = 3.0) -> dict:
        """Cores per receiver that following costs while nothing is published:
        the receivers' own polling, and the store's serving it (S3)."""
        f0 = sum(cpu_seconds(p.pid) for p in followers)
        s0 = self.s3_cpu() if c.transport == "s3" else 0.0
        t0 = time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        receivers = (sum(cpu_seconds(p.pid) for p in followers) - f0) / dt / len(followers)
        store = ((self.s3_cpu() - s0) / dt / len(followers)) if c.transport == "s3" else 0.0
        return {"receiver": receivers, "store": store}

    def version(self, c, v, store, root, trainers, maps, followers, relay_procs, relay_root) -> dict:
        """Publishes v from every trainer process at once; the coordinator's time to the commit."""
        cpu_before = [cpu_seconds(p.pid) for p in followers + relay_procs]
        store_before = self.s3_cpu() if c.transport == "s3" else 0.0
        pubs = []
        children_cpu_delta()
        start = time.monotonic()
        for k, ns in enumerate(trainers):
            shard = self.inputs.work / f"shards-p{c.trainers}" / f"v{v}" / f"s{k}"
            args = [self.dcr, "publish", "--store", store, "--version", v, "--state", root / f"state-p{k}",
                    "--process", f"{k}/{c.trainers}", "--maps", ",".join(maps), "--sender", f"{k}:{maps[k]}={shard}",
                    "--segment", SEGMENT, "--peer-timeout", 120, "--json"]
            if relay_root:
                args += ["--relay", relay_root, "--relay-insecure"]
            pubs.append(subprocess.Popen(self.net.wrap(ns, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=env()))
        report, seconds = None, None
        for k, p in enumerate(pubs):
            out, err = p.communicate()
            if k == 0:
                seconds = time.monotonic() - start
            if p.returncode != 0:
                raise SystemExit(f"trainer process {k} of {c.trainers} failed at v{v}:\n{err[-3000:]}")
            if k == 0:
                report = json.loads(out)
        pub_cpu = children_cpu_delta()  # the processes just reaped
        spent = [b - a for a, b in zip(cpu_before, [cpu_seconds(p.pid) for p in followers + relay_procs])]
        per = self.frame_bytes_by_process(store, v, c.trainers)
        return {"version": v, "seconds": seconds, "publish_cpu": pub_cpu,
                "receiver_cpu": sum(spent[:len(followers)]) / len(followers),
                "relay_cpu": sum(spent[len(followers):]),
                "store_cpu": (self.s3_cpu() - store_before) if c.transport == "s3" else 0.0,
                "share": max(per) / max(1, sum(per)), "frame_bytes": report["frame_bytes"],
                "download_bytes": report.get("download_bytes", report["frame_bytes"])}


_children_cpu = 0.0


def children_cpu_delta() -> float:
    """CPU seconds of the reaped children since the last call."""
    global _children_cpu
    t = os.times()
    total = t.children_user + t.children_system
    delta, _children_cpu = total - _children_cpu, total
    return delta


def median(rows, key):
    return statistics.median(r[key] for r in rows)


CALIBRATION = [  # (transport, trainers, receivers, cross MB/s, in-cluster MB/s); 0: unshaped
    ("relay", 1, 4, 0, 0),   # CPU per version by role, polling, the fixed cost
    ("relay", 8, 4, 0, 0),   # a trainer process's own CPU
    ("relay", 1, 1, 4, 64),  # a link's payload per byte of its rate
    ("s3", 1, 4, 0, 0),      # the store's CPU, S3 polling and fixed cost
    ("s3", 1, 1, 64, 4),     # a receiver's time per object from S3
    ("s3", 8, 4, 0, 0),      # the store's CPU for the trainer processes' peer polls
]


def calibrate(lab: Lab, cores, s3: bool) -> tuple[Params, list]:
    """Params from the CALIBRATION runs, none of them a validated configuration."""
    notes = []
    for transport, trainers, receivers, x, y in CALIBRATION if s3 else CALIBRATION[:3]:
        c = Config(dense=lab.inputs.dense, payload=0, trainers=trainers, receivers=receivers,
                   cross_link=x * MB or math.inf, in_link=y * MB or math.inf, cpu_pool=cores, transport=transport,
                   segment=SEGMENT)
        r = lab.one(c, shaped=bool(x))
        rows = r["rows"]
        c = replace(c, payload=median(rows, "download_bytes"), share=median(rows, "share"))
        notes.append({"what": f"{transport} P={trainers} R={receivers} " + (f"{x}/{y} MB/s" if x else "unshaped"),
                      "config": c, "idle": r["idle"],
                      **{k: median(rows, k) for k in ("seconds", "publish_cpu", "receiver_cpu", "relay_cpu",
                                                      "store_cpu", "download_bytes", "share")}})
        print(f"  calibration run {notes[-1]['what']}: {notes[-1]['seconds']:.3f} s", flush=True)
    one_p, eight_p, link = notes[:3]
    poll = statistics.mean(n["idle"]["receiver"] for n in (one_p, eight_p))
    process_cpu = max(0.0, (eight_p["publish_cpu"] - one_p["publish_cpu"]) / 7)
    encode_cpu = one_p["publish_cpu"] - process_cpu
    apply_cpu = statistics.mean(n["receiver_cpu"] - poll * n["seconds"] for n in (one_p, eight_p))
    relays = lambda c: math.ceil(c.receivers / c.per_relay)  # noqa: E731
    relay_cpu = statistics.mean(n["relay_cpu"] / (relays(n["config"]) * n["download_bytes"]) for n in (one_p, eight_p))
    p = Params(encode_rate=lab.inputs.dense / encode_cpu, apply_rate=lab.inputs.dense / apply_cpu, latency=0.0,
               process_cpu=process_cpu, relay_cpu=relay_cpu, poll_cpu=poll)

    def unexplained(n, q):  # the run's time that no stage of q explains
        return n["seconds"] - predict(n["config"], q).seconds
    p = replace(p, latency=unexplained(one_p, p))
    # The link run is bound by its cross link: scale the link's rate to what it carried.
    bound = predict(link["config"], p).stages["cross"]
    p = replace(p, link_efficiency=bound / (bound + unexplained(link, p)))
    if s3:
        idle, per_object = notes[3], notes[4]
        s3_poll = idle["idle"]["receiver"] - poll + idle["idle"]["store"]
        busy = idle["store_cpu"] - idle["idle"]["store"] * idle["config"].receivers * idle["seconds"]
        p = replace(p, s3_poll_cpu=s3_poll,
                    store_cpu=max(0.0, busy) / ((1 + idle["config"].receivers) * idle["download_bytes"]))
        p = replace(p, s3_latency=unexplained(idle, p))
        c = per_object["config"]
        # Bound by the receiver's link; a request per round of objects, and the fill's one
        # (none left over: concurrent requests hide behind the link).
        p = replace(p, s3_request_seconds=max(0.0, unexplained(per_object, p)) / (request_rounds(c) + 1))
        # Seven more processes polling while they wait: the store's extra CPU over the run.
        eight_s3 = notes[5]
        extra = eight_s3["store_cpu"] - idle["store_cpu"]
        p = replace(p, s3_peer_poll_cpu=max(0.0, extra) / (7 * eight_s3["seconds"]))
    for n in notes:
        n["config"] = asdict(n["config"])
    return p, notes


def configs(dense: float, payload: float, cores: float, quick: bool, s3: bool) -> list[Config]:
    """Shaped configurations: the cross-cluster link, trainers, receivers, fanout and
    in-cluster rate varied so that each stage of the model bounds some of them."""
    def c(p, r, x, y, f=2, t="relay"):
        return Config(dense=dense, payload=payload, trainers=p, receivers=r, cross_link=x * MB, in_link=y * MB,
                      fanout=f, cpu_pool=cores, segment=SEGMENT, transport=t)
    grid = [c(1, 2, 2, 16), c(2, 2, 2, 16), c(4, 2, 2, 16), c(8, 2, 2, 16),   # cross-cluster bound, P scaling
            c(1, 4, 4, 16), c(4, 4, 1, 16), c(8, 8, 1, 16),                     # other link rates
            c(2, 8, 4, 4), c(2, 16, 4, 4), c(2, 16, 4, 4, 4),                   # the tree's links bound
            c(8, 16, 8, 32), c(4, 16, 16, 64)]                                  # CPU bound
    if s3:
        grid += [c(1, 2, 2, 16, t="s3"), c(4, 4, 2, 16, t="s3"), c(8, 8, 2, 16, t="s3"),
                 c(2, 8, 8, 4, t="s3"), c(4, 16, 16, 64, t="s3")]
    return [grid[0], grid[3], grid[-1]] if quick else grid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dcr", default="build/tools/dcr/dcr")
    ap.add_argument("--size", default="256MB")
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--out", default="docs/scale")
    ap.add_argument("--quick", action="store_true", help="three configurations")
    ap.add_argument("--no-s3", action="store_true", help="the relay tree only (no radosgw)")
    a = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("needs root and iproute2 (ip, tc)")
    dcr = str(Path(a.dcr).resolve())
    cores = os.cpu_count()
    work = Path(tempfile.mkdtemp(prefix="dcr-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lab = None
    try:
        inputs = Inputs(dcr, work, a.size, a.versions)
        lab = Lab(dcr, inputs)
        s3 = not a.no_s3
        if s3:
            lab.start_s3()
        print(f"model {a.size} qwen3-moe ({inputs.dense / MB:.0f} MB), training 3%; {cores} cores; "
              f"versions 2..{a.versions} timed", flush=True)
        params, notes = calibrate(lab, cores, s3)
        payload = notes[0]["download_bytes"]
        print(f"calibration: encode {params.encode_rate / 1e9:.2f} GB/s/core, a trainer process "
              f"{params.process_cpu:.3f} CPU s, apply {params.apply_rate / 1e9:.2f} GB/s/core, relay "
              f"{params.relay_cpu * 1e9:.2f} ns/B, store {params.store_cpu * 1e9:.2f} ns/B, polling "
              f"{params.poll_cpu:.3f} cores/receiver (S3 +{params.s3_poll_cpu:.3f}), latency {params.latency:.3f} s "
              f"(S3 +{params.s3_latency:.3f}), link efficiency {params.link_efficiency:.3f}, S3 request "
              f"{params.s3_request_seconds * 1e3:.1f} ms, peer polls {params.s3_peer_poll_cpu:.3f} cores; payload "
              f"{payload / MB:.2f} MB", flush=True)
        results = []
        print(f"{'via':>5} {'P':>2} {'R':>3} {'fan':>3} {'cross':>6} {'in':>6} {'measured':>9} {'predicted':>9} "
              f"{'error':>6}  bound", flush=True)
        for c in configs(inputs.dense, payload, cores, a.quick, s3):
            rows = lab.one(c, shaped=True)["rows"]
            measured = median(rows, "seconds")
            c = replace(c, payload=median(rows, "download_bytes"), share=median(rows, "share"))
            pred = predict(c, params)
            err = pred.seconds / measured - 1
            results.append({"config": asdict(c), "measured": measured, "rows": rows, "predicted": pred.seconds,
                            "stages": pred.stages, "fill": pred.fill, "bound": pred.bound, "error": err})
            print(f"{c.transport:>5} {c.trainers:>2} {c.receivers:>3} {c.fanout:>3} {c.cross_link / MB:>6g} "
                  f"{c.in_link / MB:>6g} {measured:>9.3f} {pred.seconds:>9.3f} {err:>+6.1%}  {pred.bound}",
                  flush=True)
        doc = {"size": a.size, "dense": inputs.dense, "cores": cores, "params": asdict(params),
               "calibration": notes, "results": results}
        (out / "validation.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        worst = max(abs(r["error"]) for r in results)
        print(f"worst error {worst:.1%} over {len(results)} configurations; {out / 'validation.json'}")
    finally:
        if lab:
            lab.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
