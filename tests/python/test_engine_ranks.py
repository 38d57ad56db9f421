"""Engines of several ranks as real processes: every rank of a serving engine
is its own `dcr follow --layout` process over its own buffer files. Two
engines (vLLM-style tensor-parallel 2 and 4, the single KV head replicated
onto every rank) follow a Qwen3-MoE-like run through a file:// store. After
every version each rank's buffer files must be byte-identical to a dense load
of the new checkpoint through the same map (`dcr layout load`). One rank is
killed between versions and restarts while the next version waits for it; one
rank's buffer is corrupted behind its back at an element the next version
changes, so the xor attempt fails and the overwrite retry repairs it.

The comparison reads the buffer files as plain bytes; nothing here trusts
dcr's own digests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import dcr

from conftest import DCR_BIN, run_dcr

FAMILY, SIZE, VERSIONS = "qwen3-moe", "3MB", 4
POLL_S, HEARTBEAT_S = "0.05", "0.2"


class Rank:
    def __init__(self, root: Path, store: str, engine: str, tp: int, rank: int):
        self.root, self.store, self.engine, self.tp, self.rank = root, store, engine, tp, rank
        self.map = root / f"map-{engine}-r{rank}.json"
        self.dir = root / f"buffers-{engine}-r{rank}"
        self.proc: subprocess.Popen | None = None
        self.lives = 0
        r = run_dcr("layout", "generate", "--side", "vllm", "--family", FAMILY, "--size", SIZE, "--tp", tp,
                    "--rank", rank, "-o", self.map)
        assert r.returncode == 0, r

    def start(self) -> None:
        self.lives += 1
        self.log = self.root / f"follow-{self.engine}-r{self.rank}-{self.lives}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(DCR_BIN), "follow", "--store", self.store, "--layout", str(self.map), "--engine", self.engine,
                 "--rank", str(self.rank), "--ranks", str(self.tp), "--poll", POLL_S, "--heartbeat", HEARTBEAT_S,
                 str(self.dir)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "DCR_PROGRESS": "0"})

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)

    def version(self):
        try:
            j = json.loads((self.dir / ".dcr-rank.json").read_text())
        except (OSError, ValueError):
            return None
        return None if j["attempt"] else j["version"]

    def buffers(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.dir.iterdir()) if p.is_file() and not p.name.startswith(".")}

    def dense(self, ckpt: Path) -> dict[str, bytes]:
        out = self.root / f"dense-{self.engine}-r{self.rank}-{ckpt.name}"
        if not out.exists():
            r = run_dcr("layout", "load", ckpt, self.map, "-o", out)
            assert r.returncode == 0, r
        return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}

    def tail(self) -> str:
        return f"{self.engine} rank {self.rank} ({self.log}):\n" + "\n".join(self.log.read_text().splitlines()[-15:])


def wait_for(ranks, version, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(r.version() == version for r in ranks):
            return
        time.sleep(0.05)
    raise AssertionError(f"not every rank reached version {version}:\n" + "\n".join(r.tail() for r in ranks))


def expect_dense(ranks, ckpt: Path):
    for r in ranks:
        got, want = r.buffers(), r.dense(ckpt)
        assert got.keys() == want.keys(), f"{r.engine} rank {r.rank}: buffer files differ"
        for name in want:
            assert got[name] == want[name], (f"{r.engine} rank {r.rank} buffer {name} differs from a dense load of "
                                             f"{ckpt}\n{r.tail()}")


def publish(store: str, state: Path, version: int, ckpt: Path, **kw):
    return subprocess.Popen([str(DCR_BIN), "publish", "--store", store, "--state", str(state), "--version",
                             str(version), "--chunk", "4096", "--ack-timeout", "30", "--heartbeat-timeout", "3",
                             "--json", str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "DCR_PROGRESS": "0"}, **kw)


def finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=90)
    assert p.returncode == 0, f"publish failed: {err.decode()[-3000:]}"
    return json.loads(out)


def changed_element(r: Rank, old: Path, new: Path, buffer_part: str) -> tuple[str, int]:
    """A buffer of rank r (its id contains buffer_part) and the byte offset of
    a 2-byte element whose bits differ between dense loads of old and new."""
    a, b = r.dense(old), r.dense(new)
    for name in a:
        if buffer_part in name and a[name] != b[name]:
            i = next(i for i in range(0, len(a[name]), 2) if a[name][i:i + 2] != b[name][i:i + 2])
            return name, i
    raise AssertionError(f"no {buffer_part} buffer of rank {r.rank} changes")


def corrupt(r: Rank, old: Path, new: Path, mask: int) -> None:
    """Flips bits (mask) of a byte of r's live o_proj buffer, at an element
    the next version changes, behind the follower's back."""
    name, at = changed_element(r, old, new, "o_proj")
    with open(r.dir / name, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ mask]))


@pytest.fixture
def run(tmp_path):
    r = run_dcr("gen", "-o", tmp_path / "run", "--family", FAMILY, "--size", SIZE, "--versions", VERSIONS,
                "--update", "training", "--rate", "0.03")
    assert r.returncode == 0, r
    return tmp_path / "run"


def wait_for_acks(store: str, version: int, acks: int, publisher) -> dict:
    """Polls dcr status until ``version``'s attempt holds ``acks`` acks; its entry."""
    deadline = time.monotonic() + 120  # a guard only
    while True:
        doc = run_dcr("status", "--store", store, "--json").json()
        v = next((v for v in doc["versions"] if v["version"] == version), None)
        if v is not None and v["attempts"] and len(v["attempts"][-1]["acks"]) >= acks:
            return v
        assert time.monotonic() < deadline and publisher.poll() is None, (v, publisher.poll())
        time.sleep(0.05)


def test_two_engines_of_ranks_follow_bit_exact_through_kills_and_corruption(tmp_path, run):
    store, state = f"file://{tmp_path / 'store'}", tmp_path / "state"
    assert finish(publish(store, state, 0, run / "v0"))["version"] == 0
    engines = {"tp2": [Rank(tmp_path, store, "tp2", 2, r) for r in range(2)],
               "tp4": [Rank(tmp_path, store, "tp4", 4, r) for r in range(4)]}
    ranks = [r for e in engines.values() for r in e]
    # The single KV head is replicated onto every rank of both engines.
    for r in ranks:
        doc = json.loads(r.map.read_text())
        assert any(not c.get("primary", True) for c in doc["copies"]) or r.rank == 0
    try:
        for r in ranks:
            r.start()
        wait_for(ranks, 0)  # joined from the snapshot through their maps
        expect_dense(ranks, run / "v0")

        report = finish(publish(store, state, 1, run / "v1"))
        assert report["attempts"] == 1 and len(report["acked"]) == 6, report
        wait_for(ranks, 1)
        expect_dense(ranks, run / "v1")

        # A rank killed between versions: version 2 waits for its engine
        # (the other rank acked but the engine is incomplete) until it restarts.
        victim = engines["tp2"][1]
        victim.kill9()
        p = publish(store, state, 2, run / "v2")
        v2 = wait_for_acks(store, 2, len(ranks) - 1, p)  # every rank but the victim acked
        assert not v2["committed"] and p.poll() is None, ("version 2 committed without every rank of engine tp2", v2)
        victim.start()
        report = finish(p)
        assert sorted(report["acked"]) == sorted(f"{r.engine}-r{r.rank}" for r in ranks), report
        assert not report["retired"], report
        wait_for(ranks, 2)
        expect_dense(ranks, run / "v2")

        # A rank's buffer corrupted behind its back at an element version 3
        # changes: the xor attempt fails, the overwrite retry repairs it.
        hurt = engines["tp4"][2]
        corrupt(hurt, run / "v2", run / "v3", 0x01)
        report = finish(publish(store, state, 3, run / "v3"))
        assert report["attempts"] == 2, report
        wait_for(ranks, 3)
        expect_dense(ranks, run / "v3")
        status = run_dcr("status", "--store", store, "--json")
        assert status.returncode == 0, status
        doc = status.json()
        # The fenced xor attempt is collected once v3 commits; the hurt rank's
        # log says why it failed, and the committed attempt is an overwrite.
        v3 = next(v for v in doc["versions"] if v["version"] == 3)
        assert [a["mode"] for a in v3["attempts"]] == ["overwrite"], v3
        log = hurt.log.read_text()
        assert "cannot apply version 3" in log and "not at the digest it tracks" in log, hurt.tail()
        seen = {(x["engine"]["id"], x["engine"]["rank"], x["engine"]["ranks"]) for x in doc["receivers"]}
        assert seen == {(r.engine, r.rank, r.tp) for r in ranks}
        # Each rank's record says the partial digest it verified at version 3: an engine's add up to the commit's.
        target = next(v for v in doc["versions"] if v["version"] == 3)["target_digest"]
        for engine in engines:
            partials = [x["verified_digest"] for x in doc["receivers"] if x["engine"]["id"] == engine]
            assert dcr.add_digests(partials) == target, (engine, partials, target)
        text = run_dcr("status", "--store", store)
        assert "engine tp4 (4 ranks, 4 seen)" in text.stdout, text

        # Version 4 after all that: a plain xor attempt again.
        report = finish(publish(store, state, 4, run / "v4"))
        assert report["attempts"] == 1, report
        wait_for(ranks, 4)
        expect_dense(ranks, run / "v4")
    finally:
        for r in ranks:
            r.stop()


def test_rank_flags_are_checked(tmp_path, run):
    store, state = f"file://{tmp_path / 'store'}", tmp_path / "state"
    finish(publish(store, state, 0, run / "v0"))
    r = Rank(tmp_path, store, "e", 2, 0)
    res = run_dcr("follow", "--store", store, "--layout", r.map, "--engine", "e", "--rank", 0, "--until", 0, r.dir)
    assert res.returncode == 2 and "--ranks" in res.stderr, res
    res = run_dcr("follow", "--store", store, "--layout", r.map, "--engine", "e", "--rank", 2, "--ranks", 2,
                  "--until", 0, r.dir)
    assert res.returncode == 2 and "rank < ranks" in res.stderr, res
    # A directory holds one rank: following it as another is refused.
    res = run_dcr("follow", "--store", store, "--layout", r.map, "--engine", "e", "--rank", 0, "--ranks", 2,
                  "--until", 0, r.dir)
    assert res.returncode == 0, res
    res = run_dcr("follow", "--store", store, "--layout", r.map, "--engine", "e", "--rank", 1, "--ranks", 2,
                  "--until", 0, r.dir)
    assert res.returncode == 2 and "holds rank 0 of 2" in res.stderr, res


def test_publishing_from_trainer_shards(tmp_path, run):
    """A trainer of 4 senders (pipeline 2 x expert-parallel 2; the single KV
    head rules out tensor-parallel 2 at this size) publishes versions 1-4 from
    its shard buffer files: projected against its own baseline shards, merged
    by chunk owners. The engines end bit-exact every version; an overwrite
    retry is made from shards too; a lost shard baseline is rebuilt from the
    snapshot and the committed deltas."""
    store, state = f"file://{tmp_path / 'store'}", tmp_path / "state"
    assert finish(publish(store, state, 0, run / "v0"))["version"] == 0
    trainer = []
    for ep in range(2):
        for pp in range(2):
            m = tmp_path / f"trainer-ep{ep}-pp{pp}.json"
            r = run_dcr("layout", "generate", "--side", "megatron", "--family", FAMILY, "--size", SIZE, "--pp", 2,
                        "--ep", 2, "--pp-rank", pp, "--ep-rank", ep, "-o", m)
            assert r.returncode == 0, r
            trainer.append(m)

    def shards(v):
        out = []
        for k, m in enumerate(trainer):
            d = tmp_path / f"shards-v{v}-s{k}"
            r = run_dcr("layout", "load", run / f"v{v}", m, "-o", d)
            assert r.returncode == 0, r
            out += ["--sender", f"{m}={d}"]
        return out

    def publish_shards(v):
        p = subprocess.run([str(DCR_BIN), "publish", "--store", store, "--state", str(state), "--version", str(v),
                            "--ack-timeout", "30", "--heartbeat-timeout", "3", "--json", *shards(v)],
                           capture_output=True, timeout=90, env={**os.environ, "DCR_PROGRESS": "0"})
        assert p.returncode == 0, p.stderr.decode()[-3000:]
        return json.loads(p.stdout)

    ranks = [Rank(tmp_path, store, "tp2", 2, r) for r in range(2)] + [Rank(tmp_path, store, "tp4", 4, r) for r in range(4)]
    try:
        for r in ranks:
            r.start()
        wait_for(ranks, 0)
        report = publish_shards(1)
        assert report["attempts"] == 1 and len(report["acked"]) == 6, report
        assert 0 < report["frame_bytes"] < report["total_bytes"] / 10, report  # a delta, not the model
        wait_for(ranks, 1)
        expect_dense(ranks, run / "v1")
        # An overwrite retry from shards: a rank corrupted at a changed element.
        corrupt(ranks[1], run / "v1", run / "v2", 0x80)
        assert publish_shards(2)["attempts"] == 2
        wait_for(ranks, 2)
        expect_dense(ranks, run / "v2")
        # The shard baseline lost: rebuilt from the snapshot (v0) and the
        # committed deltas (v1, v2) through the trainer maps.
        shutil.rmtree(state / "shards")
        assert publish_shards(3)["attempts"] == 1
        wait_for(ranks, 3)
        expect_dense(ranks, run / "v3")
        assert publish_shards(4)["attempts"] == 1
        wait_for(ranks, 4)
        expect_dense(ranks, run / "v4")
    finally:
        for r in ranks:
            r.stop()
    # Version 0 is a canonical snapshot: refused from shards, with the way forward.
    p = subprocess.run([str(DCR_BIN), "publish", "--store", f"file://{tmp_path / 'other'}", "--state",
                        str(tmp_path / "st2"), "--version", "0", *shards(0)], capture_output=True, timeout=60)
    assert p.returncode == 2 and b"dcr publish" in p.stderr, p.stderr
