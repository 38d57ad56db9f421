"""A version's timeline (docs/metrics.md, "Timeline"): `dcr status --timeline
V --out TRACE.json` gathers every process's stages from the store, and
`python -m dcr.timeline` draws them.

test_a_refits_timeline_shows_every_process_and_stage
    a publisher and two followers (real processes) refit version 1; the
    trace has the publisher's row (prepare, baseline, open, encode,
    ack_wait, commit, advance, gc, in that order) and each receiver's
    (download or apply, and its ack before the commit); the publisher's
    stages add up to its publish call's total_seconds within 5%; the PNG
    is written.
test_bad_timeline_requests_are_refused
    an uncommitted version, version 0, no --out, a damaged timeline record
    (named) and a file that is not a dcr trace are refused with the reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import DCR_BIN, dcr_ok, run_dcr


def wait_for(condition, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout  # a guard against a hang, not a timing
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def refit_v1(tmp, gen_cache):
    """Publishes versions 0 and 1 of a small model with two followers; the v1 report."""
    gen, _ = gen_cache.get("llama", size="4MB", versions=1)
    store = tmp / "store"
    dcr_ok("publish", "--store", store, "--state", tmp / "state", "--version", 0, gen / "v0")
    env = dict(os.environ, DCR_PROGRESS="0")
    followers = [subprocess.Popen([str(DCR_BIN), "follow", "--store", str(store), str(tmp / rid), "--id", rid,
                                   "--until", "1", "--poll", "0.02"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
                 for rid in ("rx1", "rx2")]
    try:
        wait_for(lambda: len(list((store / "receivers").glob("*.json"))) == 2, "both followers registered")
        report = dcr_ok("publish", "--store", store, "--state", tmp / "state", "--version", 1, gen / "v1",
                        "--json").json()
        for f in followers:
            assert f.wait(timeout=120) == 0, f.stderr.read()
    finally:
        for f in followers:
            if f.poll() is None:
                f.kill()
                f.wait()
    return store, report


def test_a_refits_timeline_shows_every_process_and_stage(tmp, gen_cache):
    store, report = refit_v1(tmp, gen_cache)
    trace_path = tmp / "timeline.json"
    r = dcr_ok("status", "--store", store, "--timeline", 1, "--out", trace_path)
    assert "receiver rx1" in r.stdout and "publisher" in r.stdout and str(trace_path) in r.stdout, r
    doc = json.loads(trace_path.read_text())
    other = doc["otherData"]
    assert other["format"] == "dcr-timeline-trace" and other["version"] == 1 and other["attempt"] == report["attempt"]
    assert other["publish_seconds"] == pytest.approx(report["total_seconds"], rel=1e-6)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values())[1:] == ["receiver rx1", "receiver rx2"], names
    assert sorted(names.values())[0].startswith("publisher "), names
    rows = {names[pid]: [e for e in doc["traceEvents"] if e["pid"] == pid and e["ph"] in ("X", "i")
                         and e.get("s") != "g"] for pid in names}
    commit_ts = next(e["ts"] for e in doc["traceEvents"] if e.get("s") == "g")  # the commit record's time
    publisher = next(spans for name, spans in rows.items() if name.startswith("publisher "))
    stages = [e["name"] for e in publisher]
    assert stages == ["prepare", "baseline", "open", "encode", "ack_wait", "commit", "advance", "snapshot", "gc"], stages
    starts = [e["ts"] for e in publisher]
    assert starts == sorted(starts) and all(e["dur"] >= 0 and e["ts"] >= 0 for e in publisher)
    covered = sum(e["dur"] for e in publisher) / 1e6
    # Within 5%, or 10 ms on a refit this small: the report and the timeline
    # record are written after the last span ends, on any machine a few ms.
    assert covered == pytest.approx(report["total_seconds"], rel=0.05, abs=0.01), (covered, report["total_seconds"])
    commit_span = next(e for e in publisher if e["name"] == "commit")
    # The record's time is read just before the commit stage begins (a descheduled thread may put ms between).
    assert commit_span["ts"] - 5e4 <= commit_ts <= commit_span["ts"] + commit_span["dur"] + 5e4
    encode = next(e for e in publisher if e["name"] == "encode")
    for rid in ("rx1", "rx2"):
        spans = rows[f"receiver {rid}"]
        assert {"apply", "ack"} <= {e["name"] for e in spans}, spans
        ack = next(e for e in spans if e["name"] == "ack")
        # One machine, one clock: each receiver acked after the encode began and before the commit.
        assert encode["ts"] <= ack["ts"] <= commit_span["ts"], (encode, ack, commit_span)

    pytest.importorskip("matplotlib")
    png = tmp / "timeline.png"
    drawn = subprocess.run([sys.executable, "-m", "dcr.timeline", str(trace_path), str(png)], capture_output=True,
                           text=True, timeout=120)
    assert drawn.returncode == 0 and "3 processes" in drawn.stdout, drawn
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bad_timeline_requests_are_refused(tmp, gen_cache):
    store, report = refit_v1(tmp, gen_cache)
    for args, reason in ((["--timeline", 5, "--out", tmp / "t.json"], "version 5 is not committed"),
                         (["--timeline", 0, "--out", tmp / "t.json"], "version 0 is the run's snapshot"),
                         (["--timeline", 1], "--timeline needs --out FILE")):
        r = run_dcr("status", "--store", store, *args)
        assert r.returncode == 2 and reason in r.stderr, r
    record = next((store / "attempts" / "v0000000001" / report["attempt"] / "timeline").glob("*.json"))
    record.write_text('{"format": "dcr-timeline", "process": "p", "role": "publisher", "version": 1}')
    r = run_dcr("status", "--store", store, "--timeline", 1, "--out", tmp / "t.json")
    assert r.returncode == 2 and record.name in r.stderr and "total_seconds" in r.stderr, r
    assert not (tmp / "t.json").exists()
    (tmp / "other.json").write_text('{"traceEvents": []}')
    drawn = subprocess.run([sys.executable, "-m", "dcr.timeline", str(tmp / "other.json"), str(tmp / "x.png")],
                           capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 2 and "not a dcr timeline trace" in drawn.stderr, drawn
