#!/usr/bin/env python3
"""Refit benchmark: dcr refit time and bytes against a full copy over the same link.

For each update model and rate, generates v0 and v1, then over a fresh file store
whose every process link is limited to --mbps (DCR_STORE_FAULTS=mbps=R):
  full copy  upload v1's files once, then every receiver downloads them at once
  dcr refit  publish v1 (v0 already published and held by the receivers): encode +
             stream frames, receivers download, apply, verify, ack; commit
Prints bytes, times, the speedup and the ratio of full bytes to delta bytes (the
speedup a purely transport-bound refit would reach), and the commit latency after
the last ack (from the store's file times). Only the standard library is used.

  bench/refit_bench.py --dcr build/tools/dcr/dcr [--size 64MB] [--mbps 10] [--receivers 3] [--work DIR]

Put --work on tmpfs (e.g. /dev/shm/rb) on a machine whose disk is shared: there the
page cache drops checkpoint pages under other work's I/O, and the encode then waits on
the disk, which is not what the shaped link is meant to measure. Weights of a trainer
and of an inference engine live in memory too.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def run(cmd, env=None, **kw):
    return subprocess.run(cmd, env=env, check=True, text=True, capture_output=True, **kw)


def timed_parallel(cmds, env):
    t0 = time.monotonic()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{p.args} failed: {err}")
    return time.monotonic() - t0


def bench_one(a, update, rate, work):
    gen = os.path.join(work, f"gen-{a.family}-{a.size}-{update}-{rate}")
    if not os.path.exists(os.path.join(gen, "v1")):
        shutil.rmtree(gen, ignore_errors=True)
        run([a.dcr, "gen", "-o", gen, "--family", a.family, "--size", a.size, "--versions", "1",
             "--update", update, "--rate", str(rate), "--seed", "7"])
    store_dir = os.path.join(work, "store")
    for d in ("store", "state", "full") + tuple(f"r{i}" for i in range(a.receivers)):
        shutil.rmtree(os.path.join(work, d), ignore_errors=True)
    url = "file://" + store_dir
    env = dict(os.environ, DCR_STORE_FAULTS=f"mbps={a.mbps}", DCR_PROGRESS="0")
    files = sorted(f for f in os.listdir(os.path.join(gen, "v1")) if not f.startswith("."))
    total = sum(os.path.getsize(os.path.join(gen, "v1", f)) for f in files)

    # Full copy over the same links: one upload, then every receiver downloads.
    up = timed_parallel([[a.dcr, "store", "put", url, f"full/{f}", os.path.join(gen, "v1", f)] for f in files], env)
    os.makedirs(os.path.join(work, "full"))
    down = timed_parallel(
        [["sh", "-c", " && ".join(f"{a.dcr} store get {url} full/{f} {work}/full/{i}-{f}" for f in files)]
         for i in range(a.receivers)], env)
    shutil.rmtree(os.path.join(work, "full"))
    run([a.dcr, "store", "rm", url, "full/" + files[0]], env)

    # dcr: v0 published and joined (not timed), then v1 timed end to end.
    state = os.path.join(work, "state")
    run([a.dcr, "publish", "--store", url, "--state", state, "--version", "0", os.path.join(gen, "v0")], env)
    followers = [subprocess.Popen([a.dcr, "follow", "--store", url, "--id", f"r{i}", "--until", "1", "--poll", "0.02",
                                   "--heartbeat", "0.5", os.path.join(work, f"r{i}")], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(a.receivers)]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # every receiver joined v0
        st = json.loads(run([a.dcr, "status", "--store", url, "--json"], env).stdout)
        if sum(1 for r in st["receivers"] if r["live"] and r["state"] == "following" and r["version"] == 0) == a.receivers:
            break
        time.sleep(0.1)
    t0 = time.time()
    out = run([a.dcr, "publish", "--store", url, "--state", state, "--version", "1", "--json",
               os.path.join(gen, "v1")], env)
    publish_s = time.time() - t0
    for f in followers:
        _, err = f.communicate(timeout=600)
        if f.returncode != 0:
            raise RuntimeError(f"follower failed: {err}")
    rep = json.loads(out.stdout)
    for i in range(a.receivers):  # byte-exact check
        run([a.dcr, "diff", "--summary", os.path.join(work, f"r{i}"), os.path.join(gen, "v1")])
    attempt_dir = os.path.join(store_dir, "attempts", "v0000000001", rep["attempt"])
    acks = [os.path.getmtime(os.path.join(attempt_dir, "acks", f)) for f in os.listdir(os.path.join(attempt_dir, "acks"))]
    committed_at = os.path.getmtime(os.path.join(store_dir, "commits", "v0000000001.json"))
    commit_latency = committed_at - max(acks)
    # Timeline from the store's file times: publisher start-up (baseline load and
    # check), encode + upload (attempt.json to manifest), receivers' last ack.
    frames_dir = os.path.join(attempt_dir, "frames")
    segments = [os.path.getmtime(os.path.join(frames_dir, f)) for f in os.listdir(frames_dir)]
    timeline = dict(attempt=os.path.getmtime(os.path.join(attempt_dir, "attempt.json")) - t0,
                    first_segment=min(segments) - t0 if segments else 0.0, segments=len(segments),
                    manifest=os.path.getmtime(os.path.join(attempt_dir, "manifest.bin")) - t0,
                    last_ack=max(acks) - t0)
    refit = committed_at - t0  # to the commit; the publisher then advances its baseline and collects garbage
    full = up + down
    return dict(update=update, rate=rate, total=total, frame_bytes=rep["frame_bytes"], changed=rep["changed_words"],
                full_s=full, up_s=up, down_s=down, refit_s=refit, encode_s=rep["encode_seconds"],
                wait_s=rep["wait_seconds"], commit_latency_s=commit_latency, publish_s=publish_s, timeline=timeline)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dcr", default="build/tools/dcr/dcr")
    p.add_argument("--family", default="qwen3-moe")
    p.add_argument("--size", default="64MB")
    p.add_argument("--mbps", type=float, default=10.0, help="each process's store link, MB/s")
    p.add_argument("--receivers", type=int, default=3)
    p.add_argument("--cases", default="training:0.01,training:0.03,training:0.05,stress:0.03,stress:0.05")
    p.add_argument("--work", default="/tmp/dcr-refit-bench")
    a = p.parse_args()
    a.dcr = os.path.abspath(a.dcr)
    os.makedirs(a.work, exist_ok=True)
    print(f"refit bench: {a.family} {a.size}, {a.receivers} receivers, every process's store link {a.mbps} MB/s "
          f"(file store shaped by DCR_STORE_FAULTS), load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus", flush=True)
    hdr = (f"{'update':>8} {'rate':>5} {'delta bytes':>12} {'B/changed':>9} {'full/delta bytes':>16} "
           f"{'full copy s':>11} {'refit s':>8} {'publish s':>9} {'speedup':>8} {'speedup/bytes':>13} {'encode s':>8} {'commit after last ack s':>23}")
    print(hdr, flush=True)
    for case in a.cases.split(","):
        update, rate = case.split(":")
        r = bench_one(a, update, float(rate), a.work)
        byte_ratio = r["total"] / max(r["frame_bytes"], 1)
        speedup = r["full_s"] / r["refit_s"]
        print(f"{r['update']:>8} {r['rate']:>5} {r['frame_bytes']:>12,} {r['frame_bytes'] / max(r['changed'], 1):>9.3f} "
              f"{byte_ratio:>15.1f}x {r['full_s']:>11.2f} {r['refit_s']:>8.2f} {r['publish_s']:>9.2f} {speedup:>7.1f}x {speedup / byte_ratio:>13.2f} "
              f"{r['encode_s']:>8.2f} {r['commit_latency_s']:>23.3f}", flush=True)
        tl = r["timeline"]
        print(f"{'':>14} timeline s: attempt opened {tl['attempt']:.2f}, first of {tl['segments']} frame objects "
              f"{tl['first_segment']:.2f}, manifest {tl['manifest']:.2f}, last ack {tl['last_ack']:.2f}, "
              f"commit {r['refit_s']:.2f}; transfer alone {r['frame_bytes'] / (a.mbps * 1e6):.2f} each way", flush=True)
    print("full copy: upload once + all receivers download at once; refit: publish call to the commit record, every "
          "receiver applied, verified and acked (publish s adds advancing the baseline and GC); speedup/bytes = 1.0 means purely transport-bound")


if __name__ == "__main__":
    sys.exit(main())
