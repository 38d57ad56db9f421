"""A harness for the refit protocol as real processes over a file:// store:
`dcr publish` (coordinator + senders), `dcr follow` (receivers) and
`dcr status`, with the means to hurt them: kill -9 (at random times, at
states read from the store, or at named points through the test-only
DCR_TEST_CRASH_AT hook of dcr-faults, tools/dcr/env_fault_hooks.cc), SIGSTOP/SIGCONT, store faults
(DCR_STORE_FAULTS), and frame objects modified in the store.

It also watches the store while things run (a thread): every attempt it sees
(for the counts, since GC removes the attempts that lost), and the invariants
that must hold at every instant: no baseline and no receiver journal is ahead
of the newest commit, and no commit record ever changes.

The store is a file:// directory by default; an S3 store (tests/s3/radosgw.sh)
works too, given its URL and a read-only view of it (s3_faults.S3View): the
harness reads the store only through `Harness.view`, except for the frame
damage of test_refit.py's frames:* kinds, which need the file store.

Used by tests/python/test_refit.py. Independent of dcr's own code except for
running the binary."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import dcr
from conftest import dcr_binary, run_dcr

# Receivers poll and beat quickly so that an episode takes about a second.
POLL_S = "0.05"
HEARTBEAT_S = "0.2"
# What the publisher is told: receivers silent for HEARTBEAT_TIMEOUT_S are not
# waited for; live ones that do not ack within ACK_TIMEOUT_S are retired.
HEARTBEAT_TIMEOUT_S = 3.0
ACK_TIMEOUT_S = 8.0
CHUNK = "4096"  # elements: a 2 MB model has a few hundred chunks
PROCESS_TIMEOUT_S = 60.0  # no single publish may take longer


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env["DCR_PROGRESS"] = "0"
    for k in ("DCR_STORE_FAULTS", "DCR_TEST_CRASH_AT", "DCR_STATE_DIR"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path}: unreadable)"
    return "\n".join(f"    {line}" for line in lines[-n:])


def read_json(path: Path):
    """The parsed file, or None when it does not exist (or is being replaced)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class FileView:
    """Reads a file:// store: objects are files under its root."""

    def __init__(self, root: Path):
        self.root = root

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except OSError:
            return None

    def keys(self, prefix: str = "") -> dict[str, str | None]:
        """Every key under `prefix`; no ETags (None): compare the bytes."""
        base = self.root / prefix if prefix else self.root
        out: dict[str, str | None] = {}
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith(".dcr-")]  # .dcr-tmp: writes in progress
            for name in files:
                if not name.startswith(".dcr-"):
                    out[str(Path(dirpath, name).relative_to(self.root))] = None
        return out


def view_json(view, key: str):
    data = view.read(key)
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


def view_manifest(view, key: str):
    """The stored manifest at `key`, decoded against the run's table (None
    while either is missing or unreadable)."""
    data, run = view.read(key), view.read("run.json")
    try:
        return None if data is None or run is None else dcr.describe_manifest(data, run.decode())
    except dcr.DcrError:
        return None


def stored_manifest(attempt_dir: Path) -> dict:
    """An attempt's manifest in a file store, decoded against run.json."""
    store = attempt_dir.parents[2]
    return dcr.describe_manifest((attempt_dir / "manifest.bin").read_bytes(), (store / "run.json").read_text())


def checkpoint_files(d: Path) -> dict[str, bytes]:
    """The visible top-level files of a checkpoint directory (what a
    snapshot carries), by name."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and not p.name.startswith(".")}


class Receiver:
    """One `dcr follow` receiver: its target directory outlives its processes."""

    def __init__(self, h: "Harness", rid: str):
        self.h, self.id = h, rid
        self.target = h.root / f"target-{rid}"
        self.proc: subprocess.Popen | None = None
        self.lives = 0
        self.env: dict = {}
        self.paused = False
        self.started_at = 0.0  # time.time() when this life started
        self.expect_death = False  # started with a crash hook
        self.log: Path | None = None
        self.logs: list[Path] = []

    def start(self, env: dict | None = None) -> None:
        assert not self.alive(), f"receiver {self.id} is running"
        self.lives += 1
        self.started_at = time.time()
        self.env = dict(env or {})
        self.expect_death = "DCR_TEST_CRASH_AT" in self.env
        self.log = self.h.logs / f"follow-{self.id}-{self.lives}.log"
        self.logs.append(self.log)
        env = _env(self.env)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(dcr_binary(env)), "follow", "--store", self.h.url, "--id", self.id, "--poll", POLL_S, "--heartbeat",
                 HEARTBEAT_S, str(self.target)],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        self.paused = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self):
        return None if self.proc is None else self.proc.poll()

    def kill9(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.paused = False

    def stop(self) -> int:
        """Graceful stop (SIGTERM): the follower records itself as stopped.
        Waits first until this life has written its record (its SIGTERM
        handler is in place by then): a follower signalled while it starts
        dies of the signal, which a loaded machine makes likely."""
        if not self.alive():
            return self.returncode()
        self.resume()
        deadline = time.monotonic() + 30
        while self.alive() and time.monotonic() < deadline:
            rec = self.record()
            if rec and rec.get("heartbeat", 0) >= self.started_at:
                break
            time.sleep(0.02)
        if not self.alive():
            return self.returncode()
        os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def pause(self) -> None:
        if self.alive() and not self.paused:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.alive() and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def journal(self) -> dict | None:
        return read_json(self.target / ".dcr-follow.json")

    def record(self) -> dict | None:
        return view_json(self.h.view, f"receivers/{self.id}.json")

    def version(self) -> int | None:
        """The committed version the target holds, by its journal: None while
        it applies an attempt or downloads a snapshot (journal "attempt" set)."""
        j = self.journal()
        return None if j is None or j.get("attempt") else j.get("version")

    def describe(self) -> str:
        return (f"receiver {self.id}: alive={self.alive()} rc={self.returncode()} journal={self.journal()} "
                f"record={self.record()}\n  log {self.log}:\n{tail(self.log) if self.log else ''}")


@dataclass
class PublishRun:
    version: int
    state: Path
    proc: subprocess.Popen
    log: Path
    out: Path
    env: dict
    rc: int | None = None
    started: float = field(default_factory=time.monotonic)
    seconds: float | None = None  # wall time, once it ended

    def wait(self, timeout: float = PROCESS_TIMEOUT_S) -> int:
        if self.rc is None:
            try:
                self.rc = self.proc.wait(timeout=timeout)
                self.seconds = time.monotonic() - self.started
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(
                    f"dcr publish --version {self.version} hung for {timeout} s; log:\n{tail(self.log)}")
        return self.rc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.wait()

    def report(self) -> dict | None:
        return read_json(self.out) if self.rc == 0 else None

    def text(self) -> str:
        return f"publish v{self.version} (state {self.state.name}, env {self.env}) rc={self.rc}:\n{tail(self.log)}"


@dataclass
class Counts:
    faults: Counter = field(default_factory=Counter)
    publish_runs: int = 0
    publish_reruns: int = 0
    receiver_restarts: int = 0


class Harness:
    """A run in a file store under `root`, with its publisher state and receivers."""

    def __init__(self, root: Path, gen: Path, gen_versions: int, log=print, url: str | None = None, view=None,
                 watch_every_s: float = 0.03):
        self.root = root
        self.gen = gen
        self.gen_versions = gen_versions
        self.store = root / "store"  # a file store's directory (when url is None)
        self.url = url or f"file://{self.store}"
        self.view = view or FileView(self.store)
        self.watch_every_s = watch_every_s
        self._etags: dict[str, str] = {}
        # The publisher's state in memory, as by default (docs/protocol.md);
        # other states a test makes (root / "state-b") are on the disk.
        self._memory = Path(tempfile.mkdtemp(prefix="dcr-harness-", dir="/dev/shm")) if os.path.isdir("/dev/shm") \
            else None
        self.state = (self._memory or root) / "state"
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.receivers: dict[str, Receiver] = {}
        self.snapshot_every = 0  # --snapshot-every for every publish
        self.runs: list[PublishRun] = []
        self.counts = Counts()
        self.say = log
        # Watcher state.
        self.attempts_seen: dict[tuple[int, str], dict] = {}
        self.commits_seen: dict[int, bytes] = {}
        self.violations: list[str] = []
        self._watch_stop = threading.Event()
        self._watch_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._n = 0

    # ------------------------------------------------------------ versions

    def checkpoint(self, v: int) -> Path:
        """The checkpoint published as version v: gen/v0 for 0, then gen/v1..vK
        cycling (a delta from vK back to v1 is as good as any)."""
        if v == 0:
            return self.gen / "v0"
        return self.gen / f"v{(v - 1) % self.gen_versions + 1}"

    # ------------------------------------------------------------ processes

    def publish(self, v: int, state: Path | None = None, env: dict | None = None, attempts: int = 3,
                ack_timeout: float = ACK_TIMEOUT_S, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                snapshot_every: int | None = None) -> PublishRun:
        self._n += 1
        state = state or self.state
        log = self.logs / f"publish-{self._n:03}-v{v}.log"
        out = self.logs / f"publish-{self._n:03}-v{v}.json"
        args = [str(dcr_binary(env)), "publish", "--store", self.url, "--version", str(v), "--state", str(state),
                "--senders", "2", "--chunk", CHUNK, "--attempts", str(attempts), "--ack-timeout", str(ack_timeout),
                "--heartbeat-timeout", str(heartbeat_timeout), "--json", str(self.checkpoint(v))]
        if snapshot_every if snapshot_every is not None else self.snapshot_every:
            args[-1:-1] = ["--snapshot-every", str(snapshot_every or self.snapshot_every)]
        with open(out, "wb") as o, open(log, "wb") as e:
            proc = subprocess.Popen(args, stdout=o, stderr=e, env=_env(env))
        run = PublishRun(v, state, proc, log, out, dict(env or {}))
        self.runs.append(run)
        self.counts.publish_runs += 1
        return run

    def add_receiver(self, rid: str, env: dict | None = None) -> Receiver:
        r = Receiver(self, rid)
        self.receivers[rid] = r
        r.start(env)
        return r

    def restart(self, r: Receiver, env: dict | None = None) -> None:
        if r.alive():
            rc = r.stop()
            # One started with a crash hook may reach its crash point first.
            assert rc == 0 or (rc == -9 and r.expect_death), (
                f"receiver {r.id} did not stop cleanly (rc {rc}):\n{r.describe()}")
        r.start(env)
        self.counts.receiver_restarts += 1

    def status(self) -> dict:
        res = run_dcr("status", "--store", self.url, "--heartbeat-timeout", HEARTBEAT_TIMEOUT_S, "--json")
        assert res.returncode == 0, str(res)
        return res.json()

    def close(self) -> None:
        """Stops every process and removes the state kept in memory."""
        self.stop_all()
        if self._memory:
            shutil.rmtree(self._memory, ignore_errors=True)

    def stop_all(self) -> None:
        self.stop_watching()
        for r in self.receivers.values():
            r.resume()
            if r.alive():
                r.kill9()
        for run in self.runs:
            if run.alive():
                run.kill9()

    # ------------------------------------------------------------ the store

    def commit_path(self, v: int) -> Path:
        return self.store / "commits" / f"v{v:010}.json"

    def commit(self, v: int) -> dict | None:
        return view_json(self.view, f"commits/v{v:010}.json")

    def latest(self) -> int | None:
        vs = [int(k[9:19]) for k in self.view.keys("commits/") if k.startswith("commits/v") and k.endswith(".json")]
        return max(vs) if vs else None

    def attempt_dirs(self, v: int) -> list[Path]:
        d = self.store / "attempts" / f"v{v:010}"
        try:
            return sorted(p for p in d.iterdir() if p.is_dir())
        except OSError:
            return []

    def baseline_version(self, state: Path | None = None) -> int | None:
        doc = read_json((state or self.state) / "publisher.json")
        return None if doc is None else doc["version"]

    def wait_registered(self, rids, timeout: float = 30.0) -> None:
        """Until each receiver has a fresh heartbeat in state `following`."""
        deadline = time.monotonic() + timeout
        while True:
            pending = []
            for rid in rids:
                rec = self.receivers[rid].record()
                if not (rec and rec.get("state") == "following" and time.time() - rec.get("heartbeat", 0) < 1.0):
                    pending.append(rid)
            if not pending:
                return
            for rid in pending:
                r = self.receivers[rid]
                assert r.alive(), f"receiver {rid} died while starting:\n{r.describe()}"
            assert time.monotonic() < deadline, "receivers did not register:\n" + "\n".join(
                self.receivers[rid].describe() for rid in pending)
            time.sleep(0.05)

    def wait_receivers_at(self, v: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            behind = [r for r in self.receivers.values() if r.version() != v]
            if not behind:
                return
            for r in behind:
                assert r.alive(), f"receiver {r.id} died:\n{r.describe()}"
            assert time.monotonic() < deadline, (f"receivers did not reach version {v} in {timeout} s:\n" +
                                                 "\n".join(r.describe() for r in behind))
            time.sleep(0.05)

    # ------------------------------------------------------------ watching

    def start_watching(self) -> None:
        self._watch_thread = threading.Thread(target=self._watch, daemon=True)
        self._watch_thread.start()

    def stop_watching(self) -> None:
        self._watch_stop.set()
        if self._watch_thread:
            self._watch_thread.join(timeout=10)
            self._watch_thread = None

    def _violation(self, text: str) -> None:
        with self._lock:
            if text not in self.violations:
                self.violations.append(text)

    def _watch(self) -> None:
        while not self._watch_stop.wait(self.watch_every_s):
            try:
                self.watch_once()
            except Exception as e:  # pragma: no cover - a harness bug must not pass silently
                self._violation(f"watcher failed: {e!r}")

    def watch_once(self) -> None:
        # Journals and baselines first, commits after: whatever they claim
        # must be committed by the time we list the commits.
        claims = []
        for r in list(self.receivers.values()):
            j = r.journal()
            if j is not None:
                claims.append((f"receiver {r.id}'s journal", j["version"]))
        for state in [self.state, *sorted(self.root.glob("state-*"))]:
            b = self.baseline_version(state)
            if b is not None:
                claims.append((f"the baseline in {state.name}", b))
        self.check_commits()
        latest = self.latest()
        for who, v in claims:
            if latest is None or v > latest:
                self._violation(f"{who} is at version {v}, past the newest commit {latest}")
        # Attempts (their manifests disappear when GC removes losing attempts).
        names: dict[tuple[int, str], set[str]] = {}
        for k in self.view.keys("attempts/"):
            parts = k.split("/")
            if len(parts) < 4:
                continue
            try:
                v = int(parts[1][1:])
            except ValueError:
                continue
            names.setdefault((v, parts[2]), set()).add("/".join(parts[3:]))
        for key, files in names.items():
            prefix = f"attempts/v{key[0]:010}/{key[1]}/"
            seen = self.attempts_seen.get(key)
            if seen is None:
                doc = view_json(self.view, prefix + "attempt.json") if "attempt.json" in files else None
                if doc is None:
                    continue
                seen = self.attempts_seen[key] = {"class": doc.get("class"), "frame_bytes": None, "fenced": False}
            if seen["frame_bytes"] is None and "manifest.bin" in files:
                m = view_manifest(self.view, prefix + "manifest.bin")
                if m is not None:
                    seen["frame_bytes"] = m["totals"]["frame_bytes"]
            if "fence" in files:
                seen["fenced"] = True

    def check_commits(self) -> None:
        for k, etag in self.view.keys("commits/").items():
            name = k.split("/")[-1]
            if not (name.startswith("v") and name.endswith(".json")):
                continue
            v = int(name[1:11])
            if etag is not None and self._etags.get(k) == etag and v in self.commits_seen:
                continue  # an S3 object that has not changed (a new write gets a new ETag)
            data = self.view.read(k)
            if data is None:
                self._violation(f"commit record {name} disappeared")
                continue
            if etag is not None:
                self._etags[k] = etag
            with self._lock:
                old = self.commits_seen.setdefault(v, data)
            if old != data:
                self._violation(f"commit record of version {v} changed:\n  {old!r}\n  {data!r}")

    # ------------------------------------------------------------ checks

    def expect_identical(self, v: int) -> None:
        """Every receiver holds version v's checkpoint, byte for byte."""
        want = checkpoint_files(self.checkpoint(v))
        for r in self.receivers.values():
            got = checkpoint_files(r.target)
            assert sorted(got) == sorted(want), f"receiver {r.id}: files {sorted(got)} != {sorted(want)}"
            for name, data in want.items():
                assert got[name] == data, f"receiver {r.id}: {name} differs from {self.checkpoint(v)}/{name}"

    def digest_of(self, v: int, scratch: Path) -> str:
        """The digest of version v's checkpoint, as `dcr delta make` computes it."""
        out = scratch / f"digest-v{v}"
        shutil.rmtree(out, ignore_errors=True)
        res = run_dcr("delta", "make", self.gen / "v0", self.checkpoint(v), "-o", out, "--chunk", CHUNK, "--json")
        assert res.returncode == 0, str(res)
        shutil.rmtree(out, ignore_errors=True)
        return res.json()["target_digest"]

    def counters(self) -> dict:
        """Attempts, retries, bytes re-sent, retired and rejoined receivers."""
        committed = {}
        retired = 0
        for v, data in self.commits_seen.items():
            c = json.loads(data)
            committed[v] = c.get("attempt", "")
            retired += len(c.get("retired", []))
        attempts = len(self.attempts_seen)
        retries = sum(1 for a in self.attempts_seen.values() if a["class"] == "overwrite")
        resent = sum(a["frame_bytes"] or 0 for (v, aid), a in self.attempts_seen.items() if committed.get(v) != aid)
        sent = sum(a["frame_bytes"] or 0 for a in self.attempts_seen.values())
        rejoins = joins = 0
        for r in self.receivers.values():
            for log in r.logs:
                for line in log.read_text(errors="replace").splitlines():
                    if "joining from the snapshot" in line:
                        joins += 1
                        if "(new receiver)" not in line:
                            rejoins += 1
        return {
            "faults": dict(sorted(self.counts.faults.items())),
            "faults_total": sum(self.counts.faults.values()),
            "versions_committed": len(committed),
            "attempts": attempts,
            "retries_overwrite": retries,
            "attempts_fenced": sum(1 for a in self.attempts_seen.values() if a["fenced"]),
            "frame_bytes_sent": sent,
            "bytes_resent": resent,
            "receivers_retired": retired,
            "receivers_rejoined_from_snapshot": rejoins,
            "receiver_joins": joins,
            "receiver_restarts": self.counts.receiver_restarts,
            "publish_runs": self.counts.publish_runs,
            "publish_reruns": self.counts.publish_reruns,
        }


# ---------------------------------------------------------------- baselines

def half_advance(baseline: Path, new: Path) -> str:
    """What a publisher killed in the middle of advancing its baseline (the
    copy of the changed chunks, between the commit and publisher.json)
    leaves: one chunk half copied. Copies the first differing byte of
    `new` into `baseline`, but not the next one (a few bytes on: the same
    chunk). Returns what it did."""
    for f in sorted(new.glob("*.safetensors")):
        a, b = (baseline / f.name).read_bytes(), f.read_bytes()
        diffs = [i for i in range(len(a)) if a[i] != b[i]][:2] if a != b else []
        if len(diffs) == 2 and diffs[1] - diffs[0] < 1024:
            with open(baseline / f.name, "r+b") as fh:
                fh.seek(diffs[0])
                fh.write(b[diffs[0]:diffs[0] + 1])
            return f"{f.name}: byte {diffs[0]} advanced, byte {diffs[1]} not"
    raise AssertionError(f"{baseline} and {new} have no chunk to half-copy")


# ---------------------------------------------------------------- frame damage

def damage_frames(attempt_dir: Path, how: str, rng: random.Random) -> str:
    """Damages one frame object of an attempt in the store, the way a broken
    network or disk would: flips a byte, truncates, duplicates a frame (the
    frames after it shift), or swaps two frames. Returns what it did."""
    m = stored_manifest(attempt_dir)
    frames = m["frames"]
    by_object: dict[int, list[dict]] = {}
    for f in frames:
        by_object.setdefault(f["object"], []).append(f)
    obj = rng.choice(sorted(by_object))
    fl = sorted(by_object[obj], key=lambda f: f["offset"])
    path = attempt_dir / m["objects"][obj]
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        f = rng.choice(fl)
        at = f["offset"] + rng.randrange(f["bytes"])
        data[at] ^= 1 << rng.randrange(8)
        what = f"flipped a bit at byte {at} of {path.name} (frame of tensor {f['tensor']} chunk {f['chunk']})"
    elif how == "truncate":
        n, size = rng.randrange(len(data)), len(data)
        del data[n:]
        what = f"truncated {path.name} to {n} of {size} bytes"
    elif how == "duplicate":
        i = rng.randrange(len(fl))
        f = fl[i]
        piece = data[f["offset"]:f["offset"] + f["bytes"]]
        data[f["offset"] + f["bytes"]:f["offset"] + f["bytes"]] = piece
        what = f"duplicated frame {i} of {len(fl)} in {path.name}"
    elif how == "reorder":
        if len(fl) < 2:
            return damage_frames(attempt_dir, "corrupt", rng)
        i = rng.randrange(len(fl) - 1)
        a, b = fl[i], fl[i + 1]
        pa = bytes(data[a["offset"]:a["offset"] + a["bytes"]])
        pb = bytes(data[b["offset"]:b["offset"] + b["bytes"]])
        data[a["offset"]:b["offset"] + b["bytes"]] = pb + pa
        what = f"swapped frames {i} and {i + 1} of {len(fl)} in {path.name}"
    else:
        raise ValueError(how)
    # Replace the object the way a store does (a new file), so a reader never sees half of it.
    tmp = path.with_name(".dcr-damaged-" + path.name)  # ".dcr-" names are invisible to the store
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)
    return what
