#!/usr/bin/env python3
"""The trainer's cost per step: `dcr publish` against `dcr delta make` alone, same data, same run.

For each rate, generates v0..vK of a `dcr gen` checkpoint in memory (--work, default
/dev/shm), creates a run (version 0) in a file store there, then publishes v1..vK with
no receivers, twice: with the publisher's state in its default place (memory,
/dev/shm/dcr-<uid>/publish/...) and with --state on a disk (--disk-state). Before each
version, `dcr delta make v(k-1) vk` encodes the same step into a delta directory in
memory: the floor a publish is measured against. Per version it records the wall time
of each process, the publish report's phases (baseline: making the state hold v(k-1);
encode: frames made and written to the store, overlapped; advance: the baseline moved
to vk after the commit) and the bytes each publish process caused to be written to
storage (rusage ru_oublock, from wait4), and what the publisher held (the report's
memory: frames in flight, and in all with the baseline, staging buffers and chunk
digests). Before each publish the page cache is synced,
so that a state on a disk starts clean. Prints a table (medians over the versions) and
writes it as JSON (--json).

  bench/publish_cost_bench.py --dcr build/tools/dcr/dcr [--size 2GB] [--rates 0.01,0.03] [--versions 3]
                              [--python .venv/bin/python]

With --python (an interpreter with the dcr package), also the trainer's path, in one
child process per rate: dcr.ShardPublisher over live torch CPU tensors (state in
memory), publishing the same steps, against dcr.make_delta of each step in that
process; three ways: the tensors read in place (a CPU trainer); staged through host
mirrors copied by torch (stage=True: what CUDA tensors get, with a host memcpy for
the device copy); and staged through a copy engine paced to --link-gbs GB/s (a
device -> host link; a sleep per buffer, then the copy). Staging runs on the
publisher's copy thread, overlapped with the encode.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def run_timed(cmd):
    """Runs cmd; returns (wall seconds, stdout, bytes it caused to be written to storage)."""
    env = dict(os.environ, DCR_PROGRESS="0")
    env.pop("DCR_STATE_DIR", None)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = p.stdout.read(), p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}): {err.decode(errors='replace')}")
    return wall, out.decode(), usage.ru_oublock * 512


def memory_columns(report):
    """What the publisher held beside the trainer's tensors (the report's memory):
    frames in flight, and the total with the baseline, staging buffers and digests."""
    m = report["memory"]
    return {"in_flight": m["frames_in_flight_bytes"],
            "memory": m["baseline_bytes"] + m["staging_bytes"] + m["frames_in_flight_bytes"] + m["digest_bytes"]}


def bench_rate(a, rate):
    work = os.path.join(a.work, f"r{rate}")
    gen = os.path.join(work, "gen")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    print(f"-- rate {rate}: dcr gen {a.size}, {a.versions} versions", flush=True)
    subprocess.run([a.dcr, "gen", "-o", gen, "--family", a.family, "--size", a.size, "--versions", str(a.versions),
                    "--update", "training", "--rate", str(rate), "--seed", "7"], check=True, stdout=subprocess.DEVNULL)
    rows = {"delta make": [], "publish, state in memory (default)": [], "publish, state on disk": []}
    paths = {"publish, state in memory (default)": ("store-mem", None),
             "publish, state on disk": ("store-disk", os.path.join(a.disk_state, f"r{rate}"))}
    states = []
    for name, (store, state) in paths.items():
        if state:
            shutil.rmtree(state, ignore_errors=True)
        cmd = [a.dcr, "publish", "--store", os.path.join(work, store), "--version", "0", "--json"]
        _, out, _ = run_timed(cmd + (["--state", state] if state else []) + [os.path.join(gen, "v0")])
        states.append(json.loads(out)["state_dir"])
    for v in range(1, a.versions + 1):
        delta = os.path.join(work, "delta")
        shutil.rmtree(delta, ignore_errors=True)
        wall, out, written = run_timed([a.dcr, "delta", "make", os.path.join(gen, f"v{v - 1}"),
                                        os.path.join(gen, f"v{v}"), "-o", delta, "--json"])
        d = json.loads(out)
        rows["delta make"].append({"wall": wall, "encode": d["seconds"], "written": written,
                                   "total_bytes": d["total_bytes"], "payload": d["payload_bytes"]})
        shutil.rmtree(delta, ignore_errors=True)
        for name, (store, state) in paths.items():
            os.sync()
            cmd = [a.dcr, "publish", "--store", os.path.join(work, store), "--version", str(v), "--json"]
            wall, out, written = run_timed(cmd + (["--state", state] if state else []) + [os.path.join(gen, f"v{v}")])
            r = json.loads(out)
            rows[name].append({"wall": wall, "encode": r["encode_seconds"], "baseline": r["baseline_seconds"],
                               "advance": r["advance_seconds"], "total": r["total_seconds"], "written": written,
                               **memory_columns(r)})
        print(f"   v{v}: " + ", ".join(f"{k} {rows[k][-1]['wall']:.2f} s" for k in rows), flush=True)
    for s in states:
        shutil.rmtree(s, ignore_errors=True)
    for store, _ in paths.values():
        shutil.rmtree(os.path.join(work, store), ignore_errors=True)
    if a.python:
        out = os.path.join(work, "trainer.json")
        subprocess.run([a.python, os.path.abspath(__file__), "--dcr", a.dcr, "--link-gbs", str(a.link_gbs),
                        "--trainer-child", gen, str(a.versions), out], check=True, env=dict(os.environ, DCR_PROGRESS="0"))
        with open(out) as f:
            rows.update(json.load(f))
    shutil.rmtree(work, ignore_errors=True)
    return rows


def trainer_child(gen, versions, link_gbs, out):
    """In a child with dcr and torch: the ShardPublisher rows of one rate."""
    import dcr
    import torch

    cks = [dcr.Checkpoint.open(os.path.join(gen, f"v{v}")) for v in range(versions + 1)]
    names = cks[0].names()

    def paced(dst, src):
        time.sleep(dst.numel() * dst.element_size() / (link_gbs * 1e9))
        dst.copy_(src)

    ways = {"ShardPublisher, tensors in place": dict(stage=False),
            "ShardPublisher, staged (torch copy)": dict(stage=True),
            f"ShardPublisher, staged ({link_gbs:g} GB/s link)": dict(stage=True, copy_engine=paced)}
    rows = {"dcr.make_delta": []}
    for way, kw in ways.items():
        store_dir = os.path.join(os.path.dirname(gen), "trainer-store")
        shutil.rmtree(store_dir, ignore_errors=True)
        store = dcr.open_store("file://" + store_dir)
        live = {n: cks[0].tensor(n).clone() for n in names}
        pub = dcr.ShardPublisher(store, None, senders=[live], **kw)
        pub.publish_snapshot(live)
        rows[way] = []
        for v in range(1, versions + 1):
            for n in names:
                live[n].copy_(cks[v].tensor(n))
            t0 = time.monotonic()
            r = pub.publish(v)
            rows[way].append({"wall": time.monotonic() - t0, "encode": r["encode_seconds"],
                              "baseline": r["baseline_seconds"], "advance": r["advance_seconds"],
                              "staging": r["staging_seconds"], "written": 0, **memory_columns(r)})
            if way.endswith("in place"):
                delta = os.path.join(os.path.dirname(gen), "trainer-delta")
                shutil.rmtree(delta, ignore_errors=True)
                t0 = time.monotonic()
                dcr.make_delta(cks[v - 1], cks[v], delta)
                rows["dcr.make_delta"].append({"wall": time.monotonic() - t0, "encode": time.monotonic() - t0,
                                               "written": 0})
                shutil.rmtree(delta, ignore_errors=True)
            print(f"   trainer v{v}: {way} {rows[way][-1]['wall']:.2f} s", flush=True)
        shutil.rmtree(pub.state_dir, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
    with open(out, "w") as f:
        json.dump(rows, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcr", required=True)
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--family", default="qwen3-moe")
    ap.add_argument("--rates", default="0.01,0.03")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--work", default="/dev/shm/dcr-publish-bench", help="inputs and stores (memory)")
    ap.add_argument("--disk-state", default=os.path.expanduser("~/.cache/dcr-publish-bench"),
                    help="the on-disk state directories compared")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--python", help="an interpreter with the dcr package: also the ShardPublisher rows")
    ap.add_argument("--link-gbs", type=float, default=4.0, help="the paced copy engine's GB/s")
    ap.add_argument("--trainer-child", nargs=3, metavar=("GEN", "VERSIONS", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainer_child:
        return trainer_child(a.trainer_child[0], int(a.trainer_child[1]), a.link_gbs, a.trainer_child[2])
    a.dcr = os.path.abspath(a.dcr)
    results = {}
    for rate in [float(x) for x in a.rates.split(",")]:
        results[rate] = bench_rate(a, rate)
    shutil.rmtree(a.work, ignore_errors=True)
    shutil.rmtree(a.disk_state, ignore_errors=True)

    med = lambda xs, k: statistics.median(x[k] for x in xs)
    print(f"\n{a.size} {a.family}, training update; medians over versions 1..{a.versions}; no receivers; 'vs make': "
          "the CLI rows against dcr delta make, the ShardPublisher rows against dcr.make_delta in their process")
    print(f"{'rate':>5} {'process':<40} {'wall s':>7} {'vs make':>13} {'encode s':>8} {'baseline s':>10} "
          f"{'advance s':>9} {'staging s':>9} {'written to disk':>15} {'in flight':>10} {'held':>10}")
    for rate, rows in results.items():
        for name, xs in rows.items():
            floor = med(rows["dcr.make_delta" if name.startswith(("ShardPublisher", "dcr.make")) else "delta make"],
                        "wall")
            extra = ("", "", "") if "make" in name else (
                f"{med(xs, 'baseline'):.3f}", f"{med(xs, 'advance'):.3f}",
                f"{med(xs, 'staging'):.3f}" if "staging" in xs[0] else "")
            print(f"{rate:>5.2f} {name:<40} {med(xs, 'wall'):>7.3f} {med(xs, 'wall') / floor:>12.2f}x "
                  f"{med(xs, 'encode'):>8.3f} {extra[0]:>10} {extra[1]:>9} {extra[2]:>9} "
                  f"{med(xs, 'written') / 1e6:>12.3f} MB" +
                  ("" if "make" in name else f" {med(xs, 'in_flight') / 1e6:>7.2f} MB {med(xs, 'memory') / 1e6:>7.0f} MB"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size": a.size, "family": a.family, "versions": a.versions,
                       "results": {str(k): v for k, v in results.items()}}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
