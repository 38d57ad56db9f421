"""Trainer senders in several processes: a DeepSeek-V3-like model trained with
tensor-parallel 2 x pipeline 2 (4 senders) publishes from three real
`dcr publish --process p/3` processes, each holding only its own senders'
shard buffer files and baseline. The placement puts the two tensor-parallel
ranks of each stage in different processes, so chunk records cross processes
both ways (contribution objects through the store). A dense follower and a
2-rank vLLM-style engine follow; after every commit each must be
byte-identical to the trainer's canonical checkpoint (the dense follower's
files) or to a dense load of it through the rank's map (the ranks' buffer
files). In version 2 a worker is SIGKILLed right after writing its
contributions and restarted; it joins the attempt again (or its retry).

The comparison reads files as plain bytes; nothing here trusts dcr's digests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import DCR_BIN, dcr_binary, run_dcr
from refit_harness import checkpoint_files

FAMILY, SIZE, VERSIONS = "deepseek-v3", "2MB", 3
PLACEMENT = [0, 1, 2, 0]  # sender k (pp-major: (pp0,tp0), (pp0,tp1), (pp1,tp0), (pp1,tp1)) -> process
PROCS = 3


def env(extra=None):
    e = {k: v for k, v in os.environ.items() if k not in ("DCR_TEST_CRASH_AT", "DCR_TEST_FAIL_AT", "DCR_STATE_DIR")}
    e["DCR_PROGRESS"] = "0"
    e.update(extra or {})
    return e


def wait_until(cond, what, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def read_json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    r = run_dcr("gen", "-o", d, "--family", FAMILY, "--size", SIZE, "--versions", VERSIONS, "--seed", 7)
    assert r.returncode == 0, r
    return d


def test_senders_in_separate_processes(tmp_path, run):
    store = f"file://{tmp_path / 'store'}"
    r = run_dcr("publish", "--store", store, "--state", tmp_path / "canonical", "--version", 0, "--chunk", 4096,
                run / "v0")
    assert r.returncode == 0, r
    maps = []
    for pp in range(2):
        for tp in range(2):
            m = tmp_path / f"trainer-pp{pp}-tp{tp}.json"
            r = run_dcr("layout", "generate", "--side", "megatron", "--family", FAMILY, "--size", SIZE, "--tp", 2,
                        "--pp", 2, "--rank", tp, "--pp-rank", pp, "-o", m)
            assert r.returncode == 0, r
            maps.append(m)
    engine = []
    for rank in range(2):
        m = tmp_path / f"engine-r{rank}.json"
        r = run_dcr("layout", "generate", "--side", "vllm", "--family", FAMILY, "--size", SIZE, "--tp", 2, "--rank",
                    rank, "-o", m)
        assert r.returncode == 0, r
        engine.append(m)

    logs = tmp_path / "logs"
    logs.mkdir()
    followers = []

    def follow(argv, name):
        out = open(logs / f"{name}.log", "wb")
        followers.append(subprocess.Popen([str(DCR_BIN), "follow", "--store", store, "--poll", "0.05", "--heartbeat",
                                           "0.2", *argv], stdout=out, stderr=subprocess.STDOUT, env=env()))

    dense = tmp_path / "dense"
    follow([str(dense)], "dense")
    for rank in range(2):
        follow(["--layout", str(engine[rank]), "--engine", "e", "--rank", str(rank), "--ranks", "2",
                str(tmp_path / f"rank{rank}")], f"rank{rank}")

    def receivers_at(v):
        j = read_json(dense / ".dcr-follow.json")
        if not j or j.get("attempt") or j.get("version") != v:
            return False
        for rank in range(2):
            j = read_json(tmp_path / f"rank{rank}" / ".dcr-rank.json")
            if not j or j.get("attempt") or j.get("version") != v:
                return False
        return True

    def shards(v):
        out = []
        for k, m in enumerate(maps):
            d = tmp_path / f"shards-v{v}-s{k}"
            r = run_dcr("layout", "load", run / f"v{v}", m, "-o", d)
            assert r.returncode == 0, r
            out.append(d)
        return out

    lives = {}

    def start(v, p, dirs, extra_env=None):
        lives[p] = lives.get(p, 0) + 1
        argv = [str(dcr_binary(extra_env)), "publish", "--store", store, "--state", str(tmp_path / f"trainer-p{p}"), "--version",
                str(v), "--process", f"{p}/{PROCS}", "--maps", ",".join(str(m) for m in maps), "--sender-processes",
                ",".join(str(x) for x in PLACEMENT), "--peer-timeout", "10", "--ack-timeout", "30",
                "--heartbeat-timeout", "3", "--json"]
        for k, d in enumerate(dirs):
            if PLACEMENT[k] == p:
                argv += ["--sender", f"{k}:{maps[k]}={d}"]
        out = open(logs / f"publish-v{v}-p{p}-{lives[p]}.log", "wb")
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=out, env=env(extra_env))

    def log_tail():
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-12:])
                         for p in sorted(logs.iterdir()))

    try:
        wait_until(lambda: receivers_at(0), "the receivers to join at version 0")
        for v in range(1, VERSIONS + 1):
            dirs = shards(v)
            crash = v == 2
            procs = {p: start(v, p, dirs, {"DCR_TEST_CRASH_AT": "contributions-written"} if crash and p == 1 else None)
                     for p in range(PROCS)}
            if crash:
                assert procs[1].wait(timeout=60) == -signal.SIGKILL, log_tail()
                procs[1] = start(v, 1, dirs)  # restarted mid-version: joins the current attempt
            reports = {}
            for p, proc in procs.items():
                out, _ = proc.communicate(timeout=120)
                assert proc.returncode == 0, f"process {p} of version {v} failed\n{log_tail()}"
                reports[p] = json.loads(out)
            coord = reports[0]
            assert coord["version"] == v and len(coord["acked"]) == 3, coord
            assert 0 < coord["frame_bytes"] < coord["total_bytes"] / 4, coord
            if not crash:
                assert coord["attempts"] == 1, coord
            assert all(reports[p]["attempt"] == coord["attempt"] for p in range(PROCS)), reports
            commit = json.loads((tmp_path / "store" / "commits" / f"v{v:010}.json").read_text())
            assert commit["attempt"] == coord["attempt"]
            attempt = tmp_path / "store" / "attempts" / f"v{v:010}" / coord["attempt"]
            assert json.loads((attempt / "attempt.json").read_text())["processes"] == PROCS
            procs_dir = sorted(p.name for p in (attempt / "procs").iterdir())
            # Each process's record, and the key that signs its frame object (one per process with frames).
            assert [n for n in procs_dir if n.endswith(".json")] == ["p0.json", "p1.json", "p2.json"], procs_dir
            assert {n for n in procs_dir if n.endswith(".pub")} <= {"p0.pub", "p1.pub", "p2.pub"}, procs_dir
            assert all(len((attempt / "procs" / n).read_text().strip()) == 64 for n in procs_dir if n.endswith(".pub"))
            assert (attempt / "contrib" / "p1-p0.bin").stat().st_size > 56  # records did cross processes
            wait_until(lambda: receivers_at(v), f"the receivers at version {v}\n{log_tail()}")
            want = checkpoint_files(run / f"v{v}")
            got = checkpoint_files(dense)
            assert got.keys() == want.keys()
            for name in want:
                assert got[name] == want[name], f"version {v}: dense follower file {name} differs"
            for rank in range(2):
                d = tmp_path / f"dense-v{v}-r{rank}"
                r = run_dcr("layout", "load", run / f"v{v}", engine[rank], "-o", d)
                assert r.returncode == 0, r
                want = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
                got = {p.name: p.read_bytes() for p in (tmp_path / f"rank{rank}").iterdir()
                       if p.is_file() and not p.name.startswith(".")}
                assert got == want, f"version {v}: engine rank {rank} differs from a dense load"
        # Each process keeps only its own senders' baseline shards.
        for p in range(PROCS):
            held = sorted(x.name for x in (tmp_path / f"trainer-p{p}" / "shards").iterdir())
            assert held == [f"s{k}" for k in range(4) if PLACEMENT[k] == p], (p, held)
    finally:
        for f in followers:
            if f.poll() is None:
                f.send_signal(signal.SIGTERM)
                f.wait(timeout=30)


def test_process_flags_are_checked(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    sender = ["--sender", "0:a.json=d"]
    r = run_dcr("publish", "--store", store, "--version", 1, "--process", "3/3", "--maps", "a.json", *sender)
    assert r.returncode == 2 and "need 0 <= p < P" in r.stderr, r
    r = run_dcr("publish", "--store", store, "--version", 1, "--process", "0/2", *sender)
    assert r.returncode == 2 and "--maps" in r.stderr, r
    r = run_dcr("publish", "--store", store, "--version", 1, "--process", "x/2", "--maps", "a.json", *sender)
    assert r.returncode == 2 and "'x' is not an index" in r.stderr, r
    r = run_dcr("publish", "--store", store, "--version", 1, "--maps", "a.json", "--sender", "m=d")
    assert r.returncode == 2 and "go with --process" in r.stderr, r
