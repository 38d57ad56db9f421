"""The refit protocol as real processes over a file:// store (DESIGN section 5,
issue 5): `dcr publish`, three `dcr follow` receivers and `dcr status`.

test_publish_and_follow_end_to_end  v0..v4 to three receivers, byte for byte
test_two_coordinators_at_once       two publishers race on every version
test_failure_campaign               faults at random points, episode after
                                    episode, with the invariants checked after
                                    each one and the counts printed
test_failure_campaign_s3            the same on a real radosgw, with HTTP 5xx,
                                    timeouts and lost responses injected by a
                                    proxy (s3_faults.py); each kind once in the
                                    suite, DCR_CAMPAIGN_S3_EPISODES in scripts/soak.sh

The campaign is replayable: it prints its seed; DCR_CAMPAIGN_SEED runs the
same episodes (kinds, order, victims, damage, fault rates) again, though a
kill timed by the clock lands where the clock puts it. DCR_CAMPAIGN_EPISODES
sets a longer run (the default is one episode of each kind),
DCR_CAMPAIGN_KINDS=kind,... limits it to some kinds, and
DCR_CAMPAIGN_TIME_BOUND_S overrides the time bound (60 s + 10 s an episode):

  DCR_CAMPAIGN_SEED=1234 DCR_CAMPAIGN_EPISODES=40 pytest -s tests/python/test_refit.py -k campaign

DCR_CAMPAIGN_REPORT=FILE appends a JSON line per episode to FILE (and one at
the end, or at a failure, classed: divergence, double commit, hang, error;
tests/python/campaign_report.py): what scripts/soak.sh adds up.

The crash points inside the processes use the DCR_TEST_CRASH_AT hook of
dcr-faults, the CLI's test build (tools/dcr/env_fault_hooks.cc).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import time
from pathlib import Path

import pytest
from campaign_report import CampaignReport
from conftest import dcr_json, dcr_ok, run_dcr
from refit_harness import HEARTBEAT_TIMEOUT_S, Harness, checkpoint_files, damage_frames, half_advance

SIZE = "2MB"
RECEIVERS = ["r0", "r1", "r2"]


def gen(out: Path, versions: int, seed: int = 7, shard_size: str | None = None) -> Path:
    args = ["gen", "-o", out, "--family", "qwen3-moe", "--size", SIZE, "--versions", versions, "--update", "training",
            "--seed", seed, "--json"]
    if shard_size:
        args += ["--shard-size", shard_size]
    dcr_json(*args)
    return out


@pytest.fixture
def harness(tmp):
    made = []

    def make(versions: int, seed: int = 7, shard_size: str | None = None, log=print, **kw) -> Harness:
        h = Harness(tmp / "run", gen(tmp / "gen", versions, seed, shard_size), versions, log, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def publish_ok(h: Harness, v: int, **kw) -> dict:
    run = h.publish(v, **kw)
    assert run.wait() == 0, run.text()
    return run.report()


# ---------------------------------------------------------------- end to end

def test_publish_and_follow_end_to_end(harness, tmp):
    h = harness(4)
    v0 = publish_ok(h, 0)
    assert v0["version"] == 0 and not v0["already_committed"]
    for rid in RECEIVERS:
        h.add_receiver(rid)
    h.wait_registered(RECEIVERS)
    for v in range(1, 5):
        rep = publish_ok(h, v)
        assert rep["version"] == v and rep["attempts"] == 1 and not rep["already_committed"], rep
        assert sorted(rep["acked"]) == RECEIVERS and rep["retired"] == [], rep
        assert 0 < rep["frame_bytes"] < rep["total_bytes"] / 5, rep
        assert h.baseline_version() == v
    h.wait_receivers_at(4)
    h.expect_identical(4)
    for r in h.receivers.values():
        r.stop()
        assert r.returncode() == 0, r.describe()
        dcr_ok("diff", r.target, h.gen / "v4")
        # The follower's output says what it holds.
        assert f"holds version 4" in r.log.read_text(), r.describe()

    st = h.status()
    assert st["latest"] == 4 and st["snapshots"] == [0]
    by_version = {x["version"]: x for x in st["versions"]}
    assert sorted(by_version) == [0, 1, 2, 3, 4]
    for v in range(1, 5):
        x = by_version[v]
        assert x["committed"] and sorted(x["acked"]) == RECEIVERS and x["retired"] == [], x
        assert [a["state"] for a in x["attempts"]] == ["committed"], x
        a = x["attempts"][0]
        assert a["id"] == x["attempt"] and a["mode"] == "xor" and sorted(a["acks"]) == RECEIVERS, a
        assert x["target_digest"] == h.digest_of(v, tmp)
    assert sorted(r["id"] for r in st["receivers"]) == RECEIVERS
    assert all(r["state"] == "stopped" and r["version"] == 4 and r["behind"] == 0 for r in st["receivers"]), st
    # The human form names the same things.
    text = dcr_ok("status", "--store", h.url).stdout
    assert "latest committed version 4" in text, text

    # Publishing a committed version again is a no-op; with other bits, refused.
    again = dcr_json("publish", "--store", h.url, "--version", 4, "--state", h.state, "--json", h.gen / "v4")
    assert again["already_committed"] is True
    other = run_dcr("publish", "--store", h.url, "--version", 4, "--state", h.state, h.gen / "v3")
    assert other.returncode == 2 and "other bits" in other.stderr, str(other)

    # A receiver that joins late catches up from the snapshot and the committed deltas.
    late = tmp / "late"
    dcr_ok("follow", "--store", h.url, "--id", "late", "--until", 4, "--poll", "0.05", late)
    assert checkpoint_files(late) == checkpoint_files(h.gen / "v4")


def test_status_reports_an_unreadable_receiver_record_beside_the_others(tmp):
    """Issue 22: one garbage receivers/*.json made `dcr status` fail; the
    publisher skips such a record, and status shows it beside the others."""
    g = gen(tmp / "gen", 1)
    url = f"file://{tmp / 'store'}"
    dcr_json("publish", "--store", url, "--version", 0, "--state", tmp / "state", "--json", g / "v0")
    dcr_ok("follow", "--store", url, "--id", "r0", "--until", 0, "--poll", "0.05", tmp / "r0")
    (tmp / "store" / "receivers" / "bad.json").write_text("{not json")
    (tmp / "store" / "receivers" / "odd.json").write_text(json.dumps({"format": "dcr-receiver", "id": "odd"}))

    st = dcr_json("status", "--store", url, "--json")
    assert [r["id"] for r in st["receivers"]] == ["r0"], st
    bad = {u["key"]: u["error"] for u in st["unreadable_receivers"]}
    assert sorted(bad) == ["receivers/bad.json", "receivers/odd.json"], st
    assert "not a JSON object" in bad["receivers/bad.json"], bad
    assert "state" in bad["receivers/odd.json"], bad
    text = dcr_ok("status", "--store", url).stdout
    assert "receiver r0: stopped at v0" in text, text
    assert "receivers/bad.json is unreadable" in text and "receivers/odd.json is unreadable" in text, text


# ---------------------------------------------------------------- two coordinators

def test_two_coordinators_at_once(harness):
    h = harness(3)
    publish_ok(h, 0)
    state_b = h.root / "state-b"
    shutil.copytree(h.state, state_b)
    for rid in RECEIVERS:
        h.add_receiver(rid)
    h.wait_registered(RECEIVERS)
    h.start_watching()
    for v in range(1, 4):
        runs = [h.publish(v), h.publish(v, state=state_b)]
        for run in runs:
            assert run.wait() == 0, run.text()
        reports = [run.report() for run in runs]
        winners = [r for r in reports if not r["already_committed"]]
        assert len(winners) == 1, f"exactly one coordinator commits version {v}: {reports}"
        commit = h.commit(v)
        assert commit["attempt"] == winners[0]["attempt"], (commit, reports)
        for r in reports:
            if r["already_committed"]:
                assert r["attempt"] == commit["attempt"], f"the loser reports the committed attempt: {r}"
        h.wait_receivers_at(v)
        h.expect_identical(v)
        for state in (h.state, state_b):
            assert h.baseline_version(state) <= v
    h.stop_watching()
    assert h.violations == []
    st = h.status()
    for x in st["versions"]:
        assert sum(a["state"] == "committed" for a in x["attempts"]) <= 1, x


# ---------------------------------------------------------------- the campaign

# Fault kinds, each an episode: the version is published while the fault
# happens; then the harness restarts what died, re-runs the publish until the
# version commits, and checks every invariant.
KINDS = [
    "kill-receiver-random",          # kill -9 a receiver at a random moment of the publish
    "kill-receiver-applying",        # ... when its record in the store says "applying"
    "crash-receiver:applying",       # SIGKILL at the follower's fault points (DCR_TEST_CRASH_AT)
    "crash-receiver:applied",
    "crash-receiver:acked",
    "kill-publisher-random",         # kill -9 the publisher at a random moment
    "crash-publisher:frames-written",  # ... while streaming (frames out, no manifest)
    "crash-publisher:manifest-written",  # ... while waiting for acks
    "crash-publisher:before-commit",   # ... between the last ack and the commit
    "crash-publisher:committed",       # ... right after the commit, before its baseline moves
    "crash-publisher:advancing",       # ... in the middle of moving its baseline (one chunk half copied)
    "frames:corrupt",                # damage a frame object after the manifest appears
    "frames:truncate",
    "frames:duplicate",
    "frames:reorder",
    "store:publisher",               # DCR_STORE_FAULTS fail/lost/delay for the publisher
    "store:receivers",               # ... for some receivers
    "store:delay",                   # slow store for everyone
    "silent-receiver",               # SIGSTOP a receiver through the publish (stale heartbeat)
    "retire-receiver",               # SIGSTOP a receiver, publish with a 1 s ack deadline
    "damage-receiver",               # a receiver's target wiped, bit-flipped, without journal or a shard
    "kill-receiver-joining",         # kill -9 a receiver while it downloads the snapshot
    "two-coordinators",              # a second publisher with a copied baseline races the first
]

DEFAULT_EPISODES = len(KINDS)


def campaign_settings() -> tuple[int, int, float]:
    seed_text = os.environ.get("DCR_CAMPAIGN_SEED")
    seed = int(seed_text) if seed_text else random.SystemRandom().randrange(1, 1 << 31)
    episodes = int(os.environ.get("DCR_CAMPAIGN_EPISODES", DEFAULT_EPISODES))
    # The time bound: generous for slow shared machines, but a hang fails.
    bound = float(os.environ.get("DCR_CAMPAIGN_TIME_BOUND_S", 60 + 10 * episodes))
    return seed, episodes, bound


class Campaign:
    def __init__(self, h: Harness, seed: int, scratch: Path, report: CampaignReport | None = None, proxy=None):
        self.h = h
        self.report = report
        self.proxy = proxy  # s3_faults.FaultProxy, for the s3:* kinds
        self.rng = random.Random(seed)
        self.seed = seed
        self.scratch = scratch
        self.digests: dict[Path, str] = {}
        self.typical_publish_s = 0.5  # wall time of a publish that waits for nobody: the least of the last few
        self.publish_times: list[float] = []
        self.log_lines: list[str] = []

    def say(self, text: str) -> None:
        self.log_lines.append(text)
        print(text, flush=True)

    def faults(self, kind: str) -> None:
        self.h.counts.faults[kind] += 1

    def store_faults(self, fail: float, lost: float, delay_ms: int) -> dict:
        return {"DCR_STORE_FAULTS": f"seed={self.rng.randrange(1 << 30)},fail={fail},lost={lost},delay_ms={delay_ms}"}

    def pick_receiver(self):
        return self.h.receivers[self.rng.choice(sorted(self.h.receivers))]

    # ------------------------------------------------------------ one episode

    def episode(self, n: int, v: int, kind: str) -> None:
        h, rng = self.h, self.rng
        start = time.monotonic()
        faults_before = dict(h.counts.faults)
        runs = []
        detail = ""
        if kind == "kill-receiver-random":
            r = self.pick_receiver()
            runs.append(h.publish(v))
            time.sleep(rng.uniform(0, 1.0))
            r.kill9()
            detail = f"killed {r.id}"
            self.faults(kind)
        elif kind == "kill-receiver-applying":
            r = self.pick_receiver()
            runs.append(h.publish(v))
            hit = False
            while runs[0].alive() and not hit:
                rec = r.record()
                if rec and rec.get("state") == "applying":
                    r.kill9()
                    hit = True
                else:
                    time.sleep(0.002)
            if not hit:  # it was too quick: kill it anyway, after the commit
                r.kill9()
            detail = f"killed {r.id} " + ("while applying" if hit else "(applying not seen: after the publish)")
            self.faults(kind if hit else "kill-receiver-random")
        elif kind.startswith("crash-receiver:"):
            point = kind.split(":", 1)[1]
            r = self.pick_receiver()
            h.restart(r, {"DCR_TEST_CRASH_AT": point})
            h.wait_registered([r.id])
            runs.append(h.publish(v))
            runs[0].wait()
            # The publish may end before the receiver reaches its point (at
            # "acked", it kills itself after its ack is in the store).
            deadline = time.monotonic() + 5
            while r.alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            crashed = r.returncode() == -9
            detail = f"{r.id} " + ("crashed at " + point if crashed else "did not reach " + point)
            if crashed:
                self.faults(kind)
        elif kind == "kill-publisher-random":
            runs.append(h.publish(v))
            time.sleep(rng.uniform(0, 1.1 * self.typical_publish_s))
            killed = runs[0].alive()
            runs[0].kill9()
            detail = "killed the publisher" if killed else "the publisher finished first"
            if killed:
                self.faults(kind)
        elif kind == "crash-publisher:advancing":
            # Killed between the commit and the end of the baseline's copy:
            # the hook stops it right after the commit, and the harness does
            # the half of the copy the kill would have let happen.
            runs.append(h.publish(v, env={"DCR_TEST_CRASH_AT": "committed"}))
            if runs[0].wait() == -9 and h.baseline_version() == v - 1:
                detail = "crashed advancing the baseline: " + half_advance(h.state / "baseline", h.checkpoint(v))
                self.faults(kind)
            else:
                detail = f"did not crash at committed (rc {runs[0].rc})"
        elif kind.startswith("crash-publisher:"):
            point = kind.split(":", 1)[1]
            runs.append(h.publish(v, env={"DCR_TEST_CRASH_AT": point}))
            crashed = runs[0].wait() == -9
            detail = "crashed at " + point if crashed else f"did not reach {point} (rc {runs[0].rc})"
            if crashed:
                self.faults(kind)
        elif kind.startswith("frames:"):
            how = kind.split(":", 1)[1]
            known = set(h.attempt_dirs(v))
            for r in h.receivers.values():
                r.pause()
            paused = time.monotonic()
            runs.append(h.publish(v))
            target = None
            deadline = time.monotonic() + 20
            while target is None and runs[0].alive() and time.monotonic() < deadline:
                for d in h.attempt_dirs(v):
                    if d not in known and (d / "manifest.bin").exists():
                        target = d
                        break
                else:
                    time.sleep(0.005)
            if target is not None and time.monotonic() - paused > HEARTBEAT_TIMEOUT_S / 2:
                # The publisher may have stopped waiting for the stopped
                # receivers and committed the attempt without an ack: damaged
                # frames of a committed attempt are a loss no retry repairs
                # (see the report of issue 5), not what this episode tests.
                detail = "the manifest came too late to damage it safely"
            elif target is not None:
                detail = damage_frames(target, how, rng)
                self.faults(kind)
            else:
                detail = "no manifest appeared"
            for r in h.receivers.values():
                r.resume()
        elif kind == "store:publisher":
            # Every frame written is a request that may fail, and fails its
            # attempt: rates from "most attempts commit" to "most fail".
            env = self.store_faults(rng.choice([0.0005, 0.002, 0.01]), rng.choice([0.02, 0.1]), 5)
            runs.append(h.publish(v, env=env))
            detail = env["DCR_STORE_FAULTS"]
            self.faults(kind)
        elif kind == "store:receivers":
            chosen = rng.sample(sorted(h.receivers), rng.randint(1, len(h.receivers)))
            for rid in chosen:
                h.restart(h.receivers[rid], self.store_faults(0.05, 0.05, 5))
            h.wait_registered(chosen)
            runs.append(h.publish(v))
            detail = "receivers " + " ".join(chosen)
            self.faults(kind)
        elif kind == "store:delay":
            r = self.pick_receiver()
            h.restart(r, self.store_faults(0, 0, 100))
            h.wait_registered([r.id])
            runs.append(h.publish(v, env=self.store_faults(0, 0, 10)))
            detail = f"{r.id} up to 100 ms, publisher up to 10 ms per request"
            self.faults(kind)
        elif kind == "silent-receiver":
            r = self.pick_receiver()
            r.pause()
            runs.append(h.publish(v))
            pause = rng.uniform(0.2, HEARTBEAT_TIMEOUT_S + 1.5)
            time.sleep(pause)
            r.resume()
            detail = f"{r.id} stopped for {pause:.1f} s"
            self.faults(kind)
        elif kind == "retire-receiver":
            # Stopped with a fresh heartbeat, past a short ack deadline: retired.
            r = self.pick_receiver()
            r.pause()
            runs.append(h.publish(v, ack_timeout=1.0))
            runs[0].wait()
            retired = (h.commit(v) or {}).get("retired", [])
            if r.id in retired:  # status says so until it catches up
                shown = {x["id"]: x.get("retired_at") for x in h.status()["receivers"]}
                assert shown.get(r.id) == v, f"dcr status does not show {r.id} retired from v{v}: {shown}"
            r.resume()
            detail = f"{r.id} stopped through the publish; retired: {retired}"
            self.faults(kind)
        elif kind == "damage-receiver":
            r = self.pick_receiver()
            r.kill9()
            how = rng.choice(["wipe", "flip", "no-journal", "drop-shard"])
            if how == "wipe":
                shutil.rmtree(r.target)
            elif how == "drop-shard":
                rng.choice(sorted(r.target.glob("*.safetensors"))).unlink()
            elif how == "flip":  # one bit of one tensor, behind dcr's back
                f = rng.choice(sorted(r.target.glob("*.safetensors")))
                with open(f, "r+b") as fh:
                    (hlen,) = struct.unpack("<Q", fh.read(8))
                    header = json.loads(fh.read(hlen))
                    header.pop("__metadata__", None)
                    begin, end = header[rng.choice(sorted(header))]["data_offsets"]
                    at = 8 + hlen + begin + rng.randrange(max(end - begin, 1))
                    fh.seek(at)
                    b = fh.read(1)
                    fh.seek(at)
                    fh.write(bytes([b[0] ^ 0x10]))
            else:
                (r.target / ".dcr-follow.json").unlink()
            r.start()
            h.counts.receiver_restarts += 1
            runs.append(h.publish(v))
            detail = f"{r.id}: {how}"
            self.faults(f"{kind}:{how}")
        elif kind == "kill-receiver-joining":
            r = self.pick_receiver()
            r.kill9()
            shutil.rmtree(r.target)
            r.start()
            h.counts.receiver_restarts += 1
            # Its snapshot files appear one by one: kill it after the first.
            deadline = time.monotonic() + 10
            while r.alive() and time.monotonic() < deadline and not any(
                    p.is_file() and not p.name.startswith(".")
                    for p in (r.target.iterdir() if r.target.is_dir() else [])):
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.01))
            files = sorted(p.name for p in r.target.iterdir()) if r.target.is_dir() else []
            r.kill9()
            detail = f"killed {r.id} holding {files}"
            self.faults(kind)
            runs.append(h.publish(v))
        elif kind.startswith("s3:"):
            # HTTP faults for every process while the version publishes; the
            # receivers' own requests (polls, heartbeats, frame reads) too.
            what = kind.split(":", 1)[1]
            p = rng.choice([0.01, 0.03, 0.08])
            rates = {"mixed": {"5xx": p / 2, "timeout": p / 4, "lost": p / 4}}.get(what, {what: p})
            self.proxy.set_faults(seed=rng.randrange(1 << 30), **rates)
            runs.append(h.publish(v))
            runs[0].wait()
            injected = self.proxy.set_faults()
            for name, count in injected.items():
                h.counts.faults[f"s3:{name}"] += count
            detail = f"rates {rates}: injected {dict(injected)}"
        elif kind == "two-coordinators":
            state_b = h.root / "state-b"
            shutil.rmtree(state_b, ignore_errors=True)
            shutil.copytree(h.state, state_b)
            runs.append(h.publish(v))
            runs.append(h.publish(v, state=state_b))
            for run in runs:
                assert run.wait() == 0, run.text()
            reports = [run.report() for run in runs]
            winners = [x for x in reports if not x["already_committed"]]
            assert len(winners) == 1, f"exactly one coordinator commits version {v}: {reports}"
            assert h.commit(v)["attempt"] == winners[0]["attempt"]
            detail = f"winner {'AB'[reports.index(winners[0])]}"
            self.faults(kind)
        else:
            raise ValueError(kind)

        # ---- recovery: everything stopped runs again, without faults
        t_fault = time.monotonic() - start
        for r in h.receivers.values():
            r.resume()
        results = []
        for run in runs:
            rc = run.wait()
            results.append(rc)
            assert rc in (0, -9) or run.env or kind.startswith(("frames:", "store:", "s3:")), (
                f"publish failed without a crash or store faults:\n{run.text()}")
            if run.state != h.state and run.state.exists():
                shutil.rmtree(run.state)
        for r in h.receivers.values():
            rc = r.returncode()
            if not r.alive():
                # Receivers die only when killed (here, or by their crash hook).
                assert rc == -9, f"receiver {r.id} exited by itself (rc {rc}):\n{r.describe()}"
                r.start()
                h.counts.receiver_restarts += 1
            elif r.env:
                h.restart(r)
        main_runs = [run for run in runs if run.state == h.state]
        reruns = 0
        if not main_runs or main_runs[-1].rc != 0 or h.commit(v) is None:
            while True:
                reruns += 1
                h.counts.publish_reruns += 1
                run = h.publish(v)
                if run.wait() == 0:
                    break
                assert reruns < 4, f"version {v} did not commit after {reruns} clean re-runs:\n{run.text()}"
        for run in runs:
            if run.rc == 0 and not run.env and run.seconds:
                self.publish_times = (self.publish_times + [run.seconds])[-9:]
                self.typical_publish_s = min(self.publish_times)
        t_recover = time.monotonic() - start
        self.check(v)
        commit = h.commit(v)
        if self.report:
            faults = {k: c - faults_before.get(k, 0) for k, c in h.counts.faults.items() if c > faults_before.get(k, 0)}
            self.report.episode(episode=n, version=v, kind=kind, faults=faults, receivers_checked=len(h.receivers),
                                committed=True, attempt=commit["attempt"], retired=commit["retired"], reruns=reruns,
                                seconds=round(time.monotonic() - start, 2), detail=detail)
        self.say(f"  episode {n:3} v{v:<3} {kind:34} {detail}; publish rc {results}"
                 f"{f', {reruns} re-run(s)' if reruns else ''}; committed {commit['attempt']}"
                 f"{' retired ' + ','.join(commit['retired']) if commit['retired'] else ''}"
                 f" ({t_fault:.1f}/{t_recover:.1f}/{time.monotonic() - start:.1f} s)")

    # ------------------------------------------------------------ invariants

    def digest(self, v: int) -> str:
        ck = self.h.checkpoint(v)
        if ck not in self.digests:
            self.digests[ck] = self.h.digest_of(v, self.scratch)
        return self.digests[ck]

    def check(self, v: int) -> None:
        h = self.h
        h.wait_receivers_at(v)
        # Every live receiver equals the newest committed version byte for byte.
        assert h.latest() == v
        h.expect_identical(v)
        # Each version committed once, with the digest of its checkpoint; no gaps.
        h.watch_once()
        for u in range(v + 1):
            c = h.commit(u)
            assert c is not None, f"version {u} has no commit record"
            assert c["version"] == u and c["target_digest"] == self.digest(u), (
                f"version {u} committed with digest {c['target_digest']}, its checkpoint has {self.digest(u)}")
            if u > 0:
                assert c["base_version"] == u - 1 and c["attempt"], c
        # No baseline past a commit: after a successful publish it is at v, or
        # (a publisher killed after the commit) behind, to catch up next time.
        b = h.baseline_version()
        assert b is not None and b <= v, f"baseline at {b}, newest commit {v}"
        assert h.violations == [], "invariants broken while running:\n" + "\n".join(h.violations)


def run_campaign(h: Harness, tmp: Path, name: str, seed: int, episodes: int, bound: float, kinds: list[str],
                 replay: str, proxy=None) -> dict:
    """Runs `episodes` episodes of `kinds` on `h` (every kind once per round, in
    a seeded order), then the final checks; the counters. Writes the
    campaign's report lines (campaign_report.py)."""
    started = time.monotonic()
    h.snapshot_every = 4  # snapshots at v4, v8, ...: GC drops older ones, rejoins start from newer ones
    report = CampaignReport(name, seed, replay)
    c = Campaign(h, seed, tmp, report, proxy)
    order: list[str] = []
    n, kind = 0, "start"
    try:
        publish_ok(h, 0)
        for rid in RECEIVERS:
            h.add_receiver(rid)
        h.wait_registered(RECEIVERS)
        h.start_watching()
        for n in range(1, episodes + 1):
            if not order:  # every kind once per round, in a seeded order
                order = list(kinds)
                c.rng.shuffle(order)
            kind = order.pop()
            try:
                c.episode(n, n, kind)
            except BaseException:
                print(f"\nepisode {n} ({kind}) failed; replay with {replay}", flush=True)
                raise
            assert time.monotonic() - started < bound, (
                f"campaign over its time bound of {bound:.0f} s after {n} episodes (seed {seed})")
        n, kind = n + 1, "final-check"
        latest = h.latest()
        # A receiver that follows into a fresh directory equals the newest version too.
        fresh = tmp / "fresh"
        dcr_ok("follow", "--store", h.url, "--id", "fresh", "--until", latest, "--poll", "0.05", fresh)
        assert checkpoint_files(fresh) == checkpoint_files(h.checkpoint(latest)), (
            f"a fresh follower's files differ from version {latest}'s")
        for r in h.receivers.values():
            assert r.stop() == 0, f"receiver {r.id} did not stop cleanly: {r.describe()}"
            res = run_dcr("diff", r.target, h.checkpoint(latest))
            assert res.returncode == 0, f"receiver {r.id} differs from version {latest}: {res}"
        h.stop_watching()
        assert h.violations == [], "\n".join(h.violations)
        st = h.status()
        assert st["latest"] == latest
        for x in st["versions"]:
            assert x["version"] > latest or x["committed"], x
            assert sum(a["state"] == "committed" for a in x["attempts"]) <= 1, f"two commits: {x}"
    except BaseException as e:
        report.failure(n, kind, e)
        raise
    finally:
        h.stop_watching()
    counts = h.counters()
    counts["seed"] = seed
    counts["episodes"] = episodes
    counts["seconds"] = round(time.monotonic() - started, 1)
    counts["final_receivers_checked"] = len(h.receivers) + 1  # and the fresh follower
    report.end(episodes, counts)
    print(f"{name} failure campaign counts: " + json.dumps(counts, indent=1), flush=True)
    return counts


def test_failure_campaign(harness, tmp):
    seed, episodes, bound = campaign_settings()
    print(f"\nrefit failure campaign: DCR_CAMPAIGN_SEED={seed} DCR_CAMPAIGN_EPISODES={episodes} "
          f"(time bound {bound:.0f} s)", flush=True)
    # DCR_CAMPAIGN_KINDS=kind,kind... limits the campaign to those kinds (debugging).
    kinds = os.environ.get("DCR_CAMPAIGN_KINDS", "").split(",") if os.environ.get("DCR_CAMPAIGN_KINDS") else KINDS
    assert set(kinds) <= set(KINDS), f"unknown kinds: {set(kinds) - set(KINDS)}"
    # Sharded (three files and an index), so snapshots carry several objects.
    h = harness(min(episodes, 24), seed=seed % 1000, shard_size="800KB")
    replay = (f"DCR_CAMPAIGN_SEED={seed} DCR_CAMPAIGN_EPISODES={episodes}"
              + (f" DCR_CAMPAIGN_KINDS={','.join(kinds)}" if kinds != KINDS else "")
              + " .venv/bin/python -m pytest -s tests/python/test_refit.py -k 'campaign and not s3'")
    counts = run_campaign(h, tmp, "refit", seed, episodes, bound, kinds, replay)
    assert counts["faults_total"] > 0


# ---------------------------------------------------------------- the campaign on S3

# On the radosgw of tests/s3/radosgw.sh, every dcr process talks to it through
# s3_faults.FaultProxy. The s3:* kinds inject HTTP faults into every request
# of every process during the publish (then none during the recovery); the
# others are refit kinds that need no access to the store's files.
S3_KINDS = [
    "s3:5xx",      # 500 InternalError / 503 SlowDown instead of the server's reply
    "s3:timeout",  # no reply: held, then the connection closed; the server never saw it
    "s3:lost",     # done by the server, the reply lost
    "s3:mixed",    # all three
    "kill-publisher-random",
    "crash-publisher:before-commit",
    "kill-receiver-random",
    "crash-receiver:applied",
    "two-coordinators",
]


def s3_settings() -> dict | None:
    """The radosgw that tests/s3/radosgw.sh started (its env file loaded), or None."""
    need = ("DCR_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    if not all(os.environ.get(k) for k in need):
        return None
    return {"endpoint": os.environ["DCR_S3_ENDPOINT"], "access_key": os.environ["AWS_ACCESS_KEY_ID"],
            "secret_key": os.environ["AWS_SECRET_ACCESS_KEY"],
            "region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "default"}


def test_failure_campaign_s3(harness, tmp):
    """The campaign on a real S3 server with HTTP faults between it and dcr.
    Each kind once in the suite, DCR_CAMPAIGN_S3_EPISODES episodes in scripts/soak.sh; needs a
    radosgw running (DCR_S3_ENDPOINT, AWS_ACCESS_KEY_ID, ...: what
    scripts/test.sh and scripts/soak.sh export); DCR_CAMPAIGN_SEED,
    DCR_CAMPAIGN_KINDS and DCR_CAMPAIGN_TIME_BOUND_S as for the campaign above."""
    from s3_faults import FaultProxy, S3View

    s3 = s3_settings()
    if s3 is None:
        pytest.skip("no radosgw: DCR_S3_ENDPOINT is not set (tests/s3/radosgw.sh)")
    seed_text = os.environ.get("DCR_CAMPAIGN_SEED")
    seed = int(seed_text) if seed_text else random.SystemRandom().randrange(1, 1 << 31)
    # The suite runs each kind once; scripts/soak.sh sets the count.
    episodes = int(os.environ.get("DCR_CAMPAIGN_S3_EPISODES") or len(S3_KINDS))
    bound = float(os.environ.get("DCR_CAMPAIGN_TIME_BOUND_S", 120 + 30 * episodes))
    kinds = os.environ.get("DCR_CAMPAIGN_KINDS", "").split(",") if os.environ.get("DCR_CAMPAIGN_KINDS") else S3_KINDS
    assert set(kinds) <= set(S3_KINDS), f"unknown kinds: {set(kinds) - set(S3_KINDS)}"
    print(f"\nS3 failure campaign: DCR_CAMPAIGN_SEED={seed} DCR_CAMPAIGN_S3_EPISODES={episodes} on "
          f"{s3['endpoint']} (time bound {bound:.0f} s)", flush=True)
    proxy = FaultProxy(s3["endpoint"])
    bucket, prefix = "dcr-soak", f"run-{seed}-{os.getpid()}-{int(time.time())}/"
    # Retries bounded so that an episode's faults end within seconds; the S3
    # driver's defaults otherwise (backoff 100 ms doubling up to 10 s).
    url = f"s3://{bucket}/{prefix}?endpoint={proxy.endpoint}&addressing=path&create_bucket=1&max_attempts=6"
    view = S3View(s3["endpoint"], bucket, prefix, s3["access_key"], s3["secret_key"], s3["region"])
    h = harness(min(episodes, 24), seed=seed % 1000, shard_size="800KB", url=url, view=view, watch_every_s=0.1)
    replay = (f"DCR_CAMPAIGN_SEED={seed} DCR_CAMPAIGN_S3_EPISODES={episodes}"
              + (f" DCR_CAMPAIGN_KINDS={','.join(kinds)}" if kinds != S3_KINDS else "")
              + " .venv/bin/python -m pytest -s tests/python/test_refit.py -k campaign_s3"
              " (with a radosgw: see scripts/soak.sh)")
    try:
        counts = run_campaign(h, tmp, "s3", seed, episodes, bound, kinds, replay, proxy)
    finally:
        proxy.close()
    print(f"S3 proxy: {proxy.requests} requests, injected {dict(proxy.total_injected)}", flush=True)
    assert counts["faults_total"] > 0
    h.stop_all()
    print(f"removed the run's {view.delete_all()} objects from s3://{bucket}/{prefix}", flush=True)
