"""The relay tree as real processes on loopback (issue 6): `dcr relay`
daemons planned by `dcr relay plan`, `dcr follow --relay` receivers and
`dcr publish --relay`, all authenticated with CURVE keys from
`dcr relay keygen`, over a file:// store that stays the control plane.

test_depth_two_tree_commits_and_the_payload_crosses_once
    5 relays (fanout 2, depth 2), 8 receivers: two versions commit, every
    receiver equals the checkpoint byte for byte, no receiver downloads a
    frame object from the store, and the per-link byte counters show the
    frames entering the cluster once (sender -> root) and each link of the
    tree carrying them once.
    The receivers' acks come up the tree: the coordinator takes all of
    them from its relay client (`relay_acks`), they are in the store too, and
    each relay sends its subtree's acks up; then one version without tree
    acks (`--no-relay-acks`); the commit latency after the last ack of both
    is printed (store mtimes).
test_killing_a_middle_relay_mid_stream
    kill -9 of a depth-1 relay at a random moment (seed printed,
    DCR_RELAY_SEED replays it) while a version streams: the version commits,
    every receiver is exact, and the next version reaches everyone through
    the ancestors they re-attached to, with nothing from the store.
test_a_restarted_relay_is_rejoined
    kill -9 of a depth-1 relay, restarted later on its address: its children
    (relays and a receiver) go back to it, and the next version flows
    through it to every receiver below it, nothing from the store.
test_frames_of_a_fenced_attempt_are_dropped_by_every_relay
    an attempt that fails after its frames streamed (DCR_TEST_FAIL_AT, once
    the root accepted every frame object: DCR_TEST_PAUSE_AT) is fenced: every
    relay logs the fence, the root drops all of the attempt's objects, a frame
    object of it pushed later into a middle relay is refused and never
    forwarded, and the retry commits exact everywhere.
test_a_slow_childs_backlog_is_spooled
    a receiver behind a throttled link (--link-mbps) and a cache far smaller
    than the attempt: what leaves the cache before it was sent goes to the
    spool directory and reaches the receiver from there, nothing from the
    store; the spool is empty afterwards.
test_a_local_tree_in_one_command
    `dcr relay tree` runs a plan's relays and 4 receivers as its children:
    a version published into its root reaches every receiver exact, the
    tree stops by itself once they hold it (--until), `dcr status
    --relay-stats` shows the relays under their upstreams with per-link
    bytes; without --until, SIGINT stops every child process.
test_engine_ranks_take_their_frames_from_the_relay
    two ranks of an engine (`dcr follow --layout`) below a relay: every frame
    object through the relay, acks in the store, buffers equal to a dense
    load through each rank's map.
test_python_followers_take_their_frames_from_the_relay
    `dcr.Follower` and `dcr.Receiver.follow` below a relay: frames through
    it, bits exact.
test_a_root_pulls_from_the_store
    `dcr relay --pull-store` at the root of a chain r0 <- r1, and a publish
    without --relay (the sender writes only to the store): the root reads
    each frame object from the store once and the tree delivers them, no
    receiver downloads a frame object; an attempt fenced in the store is
    dropped by both relays.
test_unauthenticated_clients_are_refused
    a receiver with an unknown key and one without keys get nothing from the
    relay (the relay logs the refusals) and still end exact from the store.
test_a_forged_object_pushed_ahead_of_the_publisher_is_refused
    while the publisher stands after attempt.json (DCR_TEST_PAUSE_AT),
    objects under the attempt's real keys with valid frames that move
    receivers to other bits (the attempt's delta id, their base digests) are
    pushed into the root: with the receivers' key, the relay refuses the
    HELLO as a sender and the objects; with a sender's key (unsigned, and
    with a made-up signature) the relay keeps those first copies, the
    receiver refuses each (its signature does not verify against
    attempt.json's key) and takes the store's; the first attempt commits
    exact.
test_plain_tcp_only_when_asked
    a relay, follower, publisher or push without keys is refused with the
    way forward; `--insecure` runs and warns at start.
test_oversized_and_many_part_messages_leave_the_relay_up_and_small
    a raw peer declares a 16 GiB message (ZMQ_MAXMSGSIZE drops it) and a
    ZeroMQ peer sends 200,000 parts (read, dropped, counted malformed): the
    relay's VmSize and VmRSS grow by little (printed), it serves on.
test_a_receivers_key_cannot_forge_acks_or_fence
    a peer with the receivers' key sends an ACK with a forged ok for an id
    that never acked and a forged nack for the real receiver, and a FENCE:
    the fence is refused, the attempt commits first time listing exactly the
    receiver that acked in the store.
test_a_corrupt_frame_is_dropped_never_forwarded
    an object damaged on arrival at the root (test hook) and a damaged real
    frame object pushed into a middle relay are dropped there: the links below
    never carry them, receivers fetch the missing object from the store and
    end exact.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DCR_BIN, dcr_binary, dcr_json, run_dcr
from refit_harness import stored_manifest

SIZE = "4MB"
CHUNK = "4096"
PING = "0.1"
# Generous against stalls of a loaded 2-core CI machine: a relay or receiver
# that wrongly thinks its parent dead would re-attach, which the byte
# counting test would (rightly) see.
DEAD_AFTER = "2"
TIMEOUT_S = 60


_GIVEN: set = set()  # ports handed out: a closed socket's port can come back at the next bind


def free_address() -> str:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return f"tcp://127.0.0.1:{port}"


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join("    " + line for line in path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"    ({path} unreadable)"


def env() -> dict:
    e = dict(os.environ)
    e["DCR_PROGRESS"] = "0"
    for k in ("DCR_STORE_FAULTS", "DCR_TEST_CRASH_AT", "DCR_STATE_DIR", "DCR_TEST_CORRUPT_NTH"):
        e.pop(k, None)
    return e


class Tree:
    """A run: generated versions, a store, keys, relays and receivers."""

    def __init__(self, root: Path, versions: int = 2):
        self.root = root
        self.gen = root / "gen"
        dcr_json("gen", "-o", self.gen, "--family", "qwen3-moe", "--size", SIZE, "--versions", versions, "--update",
                 "stress", "--rate", "0.03", "--seed", 11, "--json")
        self.store = root / "store"
        self.url = f"file://{self.store}"
        self.logs = root / "logs"
        self.logs.mkdir()
        keys = root / "keys"
        keys.mkdir()
        for name in ("relays", "clients", "senders", "stranger"):
            res = run_dcr("relay", "keygen", keys / name)
            assert res.returncode == 0, str(res)
        self.relay_key, self.relay_pub = keys / "relays.key", keys / "relays.pub"
        self.client_key, self.stranger_key = keys / "clients.key", keys / "stranger.key"
        self.sender_key = keys / "senders.key"
        # Each role its own key: receivers share one, and cannot act as senders.
        self.allow = keys / "allow"
        self.allow.write_text("# the relays, their receivers, the publishers\n" +
                              "".join(f"{role} {(keys / f'{name}.pub').read_text()}"
                                      for role, name in (("relay", "relays"), ("receiver", "clients"),
                                                         ("sender", "senders"))))
        self.relays: dict[str, dict] = {}  # id -> plan node
        self.relay_procs: dict[str, subprocess.Popen] = {}
        self.receivers: dict[str, dict] = {}
        self.procs: list[subprocess.Popen] = []

    # ---------------------------------------------------------------- plan

    def plan(self, ids: list[str], fanout: int) -> dict:
        listing = [{"id": i, "address": free_address(), "cluster": "rollout"} for i in ids]
        path = self.root / "relays.json"
        path.write_text(json.dumps(listing))
        plan = dcr_json("relay", "plan", "--relays", path, "--fanout", fanout)
        self.relays = {n["id"]: n for n in plan["relays"]}
        return plan

    def start_relay(self, rid: str, extra_env: dict | None = None, extra: tuple = (),
                    dead_after: str = DEAD_AFTER) -> None:
        n = self.relays[rid]
        args = [str(DCR_BIN), "relay", "--id", rid, "--listen", n["address"], "--key", str(self.relay_key), "--allow",
                str(self.allow), "--stats", str(self.stats_path(rid)), "--ping", PING, "--dead-after", dead_after,
                *map(str, extra)]
        for up in n["upstream"]:
            args += ["--parent", up]
        e = env()
        e.update(extra_env or {})
        log = self.logs / f"relay-{rid}.log"
        args[0] = str(dcr_binary(e))
        with open(log, "ab") as out:
            p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=e)
        self.relay_procs[rid] = p
        self.procs.append(p)

    def start_chain(self, ids: list[str], placement: dict[str, str], until: int, relay_env: dict | None = None,
                    relay_extra: dict | None = None, attached: tuple = ()) -> None:
        """A chain (fanout 1) of relays `ids`, v0 published from the store, the receivers of `placement`
        (receiver -> relay) started; until each relay, receiver and `attached` peer said HELLO."""
        self.plan(ids, 1)
        self.publish_ok(0, relay=False)
        for rid in ids:
            self.start_relay(rid, (relay_env or {}).get(rid), (relay_extra or {}).get(rid, ()))
        for eid, rid in placement.items():
            self.start_receiver(eid, rid, until)
        self.wait_registered()
        peers = {f"relay {b}": a for a, b in zip(ids, ids[1:])}
        peers.update({f"receiver {e}": r for e, r in placement.items()})
        peers.update(dict(attached))
        self.wait_attached(peers)

    def stats_path(self, rid: str) -> Path:
        return self.root / f"stats-{rid}.json"

    def stop_relays(self) -> dict[str, dict]:
        """SIGTERM every live relay (each writes its stats at exit); their stats by id."""
        for p in self.relay_procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for rid, p in self.relay_procs.items():
            p.wait(timeout=20)
        return {rid: read_json(self.stats_path(rid)) for rid in self.relay_procs}

    # ---------------------------------------------------------------- receivers

    def start_receiver(self, rid: str, relay: str | None, until: int, key: Path | None = None,
                       no_keys: bool = False, rank: tuple[Path, str, int, int] | None = None,
                       dead_after: str = DEAD_AFTER) -> None:
        """A `dcr follow` receiver below `relay`; with `rank` (map, engine, rank, ranks), a rank of an
        engine following into its buffer files."""
        target = self.root / f"target-{rid}"
        log = self.logs / f"follow-{rid}.log"
        args = [str(DCR_BIN), "follow", "--store", self.url, "--id", rid, "--poll", "0.05", "--heartbeat", "0.2",
                "--until", str(until), str(target)]
        if rank:
            args += ["--layout", str(rank[0]), "--engine", rank[1], "--rank", str(rank[2]), "--ranks", str(rank[3])]
        if relay:
            n = self.relays[relay]
            for addr in [n["address"], *n["upstream"]]:
                args += ["--relay", addr]
            args += ["--relay-quiet", "3.5", "--relay-dead-after", dead_after]
            if no_keys:
                args += ["--relay-insecure"]
            else:
                args += ["--relay-key", str(key or self.client_key), "--relay-pub", str(self.relay_pub)]
        with open(log, "wb") as out:
            p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env())
        self.receivers[rid] = {"proc": p, "target": target, "log": log}
        self.procs.append(p)

    def wait_registered(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        for rid, r in self.receivers.items():
            while True:
                rec = read_json(self.store / "receivers" / f"{rid}.json")
                if rec and rec.get("state") == "following" and time.time() - rec["heartbeat"] < 1.0:
                    break
                assert r["proc"].poll() is None, f"receiver {rid} died:\n{tail(r['log'])}"
                assert time.monotonic() < deadline, f"receiver {rid} did not register:\n{tail(r['log'])}"
                time.sleep(0.05)

    def wait_attached(self, peers: dict[str, str], timeout: float = 30) -> None:
        """Until each "<kind> <id>" in `peers` (value: the relay it attaches
        to) has said HELLO there: a receiver that is not attached yet when an
        attempt streams rightly takes the store's copy."""
        deadline = time.monotonic() + timeout
        for who, relay in peers.items():
            log = self.logs / f"relay-{relay}.log"
            while f"{who} attached" not in (log.read_text() if log.exists() else ""):
                assert time.monotonic() < deadline, f"{who} did not attach to {relay}:\n{tail(log)}"
                time.sleep(0.05)
            if who.startswith("receiver ") and who[len("receiver "):] in self.receivers:
                self.wait_heard(who[len("receiver "):], deadline)

    def wait_heard(self, rid: str, deadline: float, after: str = "") -> None:
        """Until receiver `rid` logged that it heard from its relay (after the last line containing `after`):
        only then does it count itself attached and leave a streaming attempt's objects to the relay."""
        log = self.receivers[rid]["log"]
        while "attached to relay" not in (log.read_text().rsplit(after, 1)[-1] if after else log.read_text()):
            assert time.monotonic() < deadline, f"receiver {rid} did not hear from its relay:\n{tail(log)}"
            time.sleep(0.05)

    def wait_receivers(self, timeout: float = TIMEOUT_S) -> None:
        for rid, r in self.receivers.items():
            try:
                rc = r["proc"].wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"receiver {rid} did not finish:\n{tail(r['log'])}")
            assert rc == 0, f"receiver {rid} failed (rc {rc}):\n{tail(r['log'])}"

    def carried(self, rid: str) -> list[dict]:
        """Per applied attempt: frame objects from the relay / the store, from the follower's log."""
        out = []
        for line in self.receivers[rid]["log"].read_text().splitlines():
            if ": frame objects " in line and " from the relay, " in line:
                rest = line.split(": frame objects ", 1)[1]
                relayed, total = rest.split(" ", 1)[0].split("/")
                store_part = rest.split(" from the relay, ", 1)[1]
                out.append({"version": int(line.split("version ", 1)[1].split(" ", 1)[0]), "relayed": int(relayed),
                            "total": int(total), "store_objects": int(store_part.split(" ", 1)[0]),
                            "store_bytes": int(store_part.split("(", 1)[1].split(" ", 1)[0])})
        return out

    def assert_exact(self, v: int) -> None:
        for rid, r in self.receivers.items():
            res = run_dcr("diff", "--json", "--summary", self.gen / f"v{v}", r["target"])
            assert res.returncode == 0, f"receiver {rid} differs from v{v}: {res}\n{tail(r['log'])}"

    # ---------------------------------------------------------------- publish

    def publish(self, v: int, relay: bool = True, segment: str = "64KiB", extra_env: dict | None = None,
                extra: tuple = (), heartbeat_timeout: str = "3") -> subprocess.Popen:
        args = [str(DCR_BIN), "publish", "--store", self.url, "--version", str(v), "--state", str(self.root / "state"),
                "--senders", "2", "--chunk", CHUNK, "--segment", segment, "--ack-timeout", "30",
                "--heartbeat-timeout", heartbeat_timeout, "--json", *extra, str(self.gen / f"v{v}")]
        if relay:
            root = next(n for n in self.relays.values() if n["parent"] is None)
            args[2:2] = ["--relay", root["address"], "--relay-key", str(self.sender_key), "--relay-pub",
                         str(self.relay_pub)]
        log = self.logs / f"publish-v{v}.log"
        e = env()
        e.update(extra_env or {})
        args[0] = str(dcr_binary(e))
        with open(log, "wb") as out:
            p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=e)
        p.log = log  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def publish_ok(self, v: int, relay: bool = True, extra: tuple = (), extra_env: dict | None = None) -> dict:
        """Publishes version v; its JSON report."""
        return self.report(self.publish(v, relay, extra=extra, extra_env=extra_env), v)

    def report(self, p: subprocess.Popen, v: int) -> dict:
        """Waits for publish `p` of version v to succeed; its JSON report."""
        rc = p.wait(timeout=TIMEOUT_S)
        assert rc == 0, f"publish v{v} failed:\n{tail(p.log)}"
        lines = p.log.read_text().splitlines()
        start, end = lines.index("{"), len(lines) - lines[::-1].index("}")
        return json.loads("\n".join(lines[start:end]))

    def publish_paused(self, v: int, point: str) -> tuple[subprocess.Popen, Path, Path]:
        """Publishes version v, standing at fault point `point` (DCR_TEST_PAUSE_AT, a handshake) until
        the returned file exists; and the attempt's directory in the store."""
        go = self.root / f"go-v{v}"
        p = self.publish(v, extra_env={"DCR_TEST_PAUSE_AT": f"{point}:{go}"})
        wait_logged(p.log, f"DCR_TEST_PAUSE_AT: waiting at {point}")
        (attempt,) = (self.store / "attempts" / f"v{v:010}").iterdir()
        return p, go, attempt

    def commit_latency(self, v: int) -> float:
        """Seconds from the last ack's arrival in the store to the commit record (file mtimes)."""
        commit = self.store / "commits" / f"v{v:010}.json"
        acks = (self.store / "attempts" / f"v{v:010}" / read_json(commit)["attempt"] / "acks").iterdir()
        return commit.stat().st_mtime - max(a.stat().st_mtime for a in acks)

    def committed_frame_bytes(self, v: int) -> int:
        commit = read_json(self.store / "commits" / f"v{v:010}.json")
        frames = self.store / "attempts" / f"v{v:010}" / commit["attempt"] / "frames"
        return sum(p.stat().st_size for p in frames.iterdir())

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_logged(log: Path, text: str, timeout: float = 30) -> None:
    """Until `log` contains `text` (what a process says once it has done something)."""
    deadline = time.monotonic() + timeout
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        assert time.monotonic() < deadline, f"{log.name} never said '{text}':\n{tail(log)}"
        time.sleep(0.05)


def fresh_stats(t: Tree, rid: str, timeout: float = 30) -> dict:
    """Relay `rid`'s stats as it holds them now: the file it rewrites every second, read once it
    was written after this call began."""
    since, deadline = time.time(), time.monotonic() + timeout
    path = t.stats_path(rid)
    while not (path.exists() and path.stat().st_mtime > since and (stats := read_json(path))):
        assert time.monotonic() < deadline, f"relay {rid} did not rewrite {path}"
        time.sleep(0.05)
    return stats


@pytest.fixture
def tree(tmp):
    made = []

    def make(**kw) -> Tree:
        t = Tree(tmp / f"tree{len(made)}", **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.kill_all()


RELAYS = ["r0", "r1", "r2", "r3", "r4"]  # fanout 2: r0 <- r1, r2; r1 <- r3, r4
PLACEMENT = {"e0": "r0", "e1": "r1", "e2": "r2", "e3": "r2", "e4": "r3", "e5": "r3", "e6": "r4", "e7": "r4"}


def start_tree(t: Tree, until: int) -> dict:
    plan = t.plan(RELAYS, 2)
    assert plan["depth"] == 2 and plan["roots"] == ["r0"]
    assert t.relays["r3"]["upstream"] == [t.relays["r1"]["address"], t.relays["r0"]["address"]]
    t.publish_ok(0, relay=False)  # the run and its snapshot (receivers join from the store)
    for rid in RELAYS:
        t.start_relay(rid)
    for rid, relay in PLACEMENT.items():
        t.start_receiver(rid, relay, until)
    t.wait_registered()
    t.wait_attached({**{f"relay {r}": t.relays[r]["parent"] for r in RELAYS[1:]},
                     **{f"receiver {e}": r for e, r in PLACEMENT.items()}})
    return plan


def test_depth_two_tree_commits_and_the_payload_crosses_once(tree):
    t = tree()
    start_tree(t, until=2)
    r1 = t.publish_ok(1)
    r2 = t.publish_ok(2, extra=("--no-relay-acks",))
    t.wait_receivers()
    t.assert_exact(2)
    # v1: every ack came up the tree (and is in the store as well); v2: from the store alone.
    assert r1["relay_acks"] == len(PLACEMENT) and sorted(r1["acked"]) == sorted(PLACEMENT), r1
    assert r2["relay_acks"] == 0 and sorted(r2["acked"]) == sorted(PLACEMENT), r2
    for v in (1, 2):
        commit = read_json(t.store / "commits" / f"v{v:010}.json")
        acks = t.store / "attempts" / f"v{v:010}" / commit["attempt"] / "acks"
        assert sorted(p.stem for p in acks.iterdir()) == sorted(PLACEMENT), v
    print(f"commit after the last ack: {1000 * t.commit_latency(1):.1f} ms with acks up the tree, "
          f"{1000 * t.commit_latency(2):.1f} ms polling the store")
    payload = t.committed_frame_bytes(1) + t.committed_frame_bytes(2)
    for rid in PLACEMENT:
        carried = t.carried(rid)
        assert [c["version"] for c in carried] == [1, 2], (rid, carried)
        assert all(c["store_objects"] == 0 and c["store_bytes"] == 0 and c["relayed"] == c["total"] for c in carried), (
            f"receiver {rid} downloaded frame objects from the store: {carried}")
    stats = t.stop_relays()
    # Into the cluster: only the sender -> root link, carrying each frame object once.
    root_in = [link for link in stats["r0"]["links"] if link["kind"] == "sender"]
    assert sum(link["bytes_in"] for link in root_in) == payload, (root_in, payload)
    assert stats["r0"]["accepted_bytes"] == payload
    # Inside it, every link of the tree carries them once (nothing is sent twice).
    for rid in RELAYS[1:]:
        up = [link for link in stats[rid]["links"] if link["kind"] == "upstream"]
        assert sum(link["bytes_in"] for link in up) == payload, (rid, up)
        assert stats[rid]["duplicates"] == 0 and stats[rid]["dropped_corrupt"] == 0
    for rid, s in stats.items():
        for link in s["links"]:
            if link["kind"] in ("relay", "receiver"):
                assert link["bytes_out"] == payload, (rid, link)
    # Acks: each relay got its subtree's (2 versions x receivers below it, each once) and sent them all up;
    # the root sends them to each sender attached (and what it holds to a sender when it attaches).
    below = {"r0": 8, "r1": 5, "r2": 2, "r3": 2, "r4": 2}
    for rid, n in below.items():
        assert stats[rid]["acks_in"] == 2 * n, (rid, stats[rid])
        assert stats[rid]["acks_out"] == 2 * n if rid != "r0" else stats[rid]["acks_out"] >= 2 * n, (rid, stats[rid])
        assert stats[rid]["ack_messages_out"] <= stats[rid]["ack_messages_in"] or rid == "r0", (rid, stats[rid])
    # Notices (attempt opened, manifest written, version committed: three per version) reach the root from the
    # publisher, and every relay below passes on at least v2's (the tree carried v1's frames: it was attached).
    assert stats["r0"]["notices"] == 6, stats["r0"]
    assert all(stats[rid]["notices"] >= 3 for rid in RELAYS[1:]), {rid: stats[rid]["notices"] for rid in RELAYS}
    shown = run_dcr("relay", "status", *[t.stats_path(rid) for rid in RELAYS])
    assert shown.returncode == 0, str(shown)
    assert f"relay r3 at {t.relays['r3']['address']}, upstream r1 {t.relays['r1']['address']}" in shown.stdout, shown
    # The relays stop together: a parent may see a child leave before it writes its last stats.
    assert re.search(r"-> relay r3( \(detached\))?: ", shown.stdout) and "-> receiver e4" in shown.stdout, shown.stdout
    assert "<- sender publish-" in shown.stdout, shown.stdout
    print(shown.stdout)
    print(f"relay tree: {len(PLACEMENT)} receivers, {payload} bytes of frames crossed into the cluster once; "
          f"the store served none")


def test_killing_a_middle_relay_mid_stream(tree):
    seed = int(os.environ.get("DCR_RELAY_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"relay kill: seed {seed} (DCR_RELAY_SEED={seed} replays it)")
    t = tree(versions=2)
    start_tree(t, until=2)
    # Small segments and a slow store (each operation sleeps up to 40 ms) make
    # the attempt stream for a second or so, and the kill lands inside it.
    p = t.publish(1, segment="8KiB", extra_env={"DCR_STORE_FAULTS": f"seed={seed},delay_ms=40"})
    time.sleep(rng.uniform(0.1, 0.9))
    t.relay_procs["r1"].kill()  # SIGKILL
    t.relay_procs["r1"].wait()
    print(f"relay kill: r1 killed {'during' if p.poll() is None else 'after'} publish v1")
    rc = p.wait(timeout=TIMEOUT_S)
    assert rc == 0, f"publish v1 failed after r1 died:\n{tail(p.log)}"
    # Everyone under r1 re-attached to its ancestor r0; the next version comes through the tree alone.
    t.publish_ok(2)
    t.wait_receivers()
    t.assert_exact(2)
    # e1 was r1's own receiver; the receivers of r3 and r4 kept their relays.
    assert "attaching to " + t.relays["r0"]["address"] in t.receivers["e1"]["log"].read_text(), \
        tail(t.receivers["e1"]["log"])
    for rid in PLACEMENT:
        v2 = [c for c in t.carried(rid) if c["version"] == 2]
        assert v2 and v2[0]["store_objects"] == 0, f"{rid} needed the store for v2: {v2}\n{tail(t.receivers[rid]['log'])}"
    stats = t.stop_relays()
    # r3 and r4 left their dead parent for r0.
    for rid in ("r3", "r4"):
        assert stats[rid]["upstream"] == t.relays["r0"]["address"], (rid, stats[rid])


def test_a_restarted_relay_is_rejoined(tree):
    t = tree(versions=2)
    start_tree(t, until=2)
    t.relay_procs["r1"].kill()  # SIGKILL
    t.relay_procs["r1"].wait()
    t.publish_ok(1)  # through r0 to everyone (r3, r4, e1 re-attached to it)
    t.start_relay("r1")  # the same address; its log is appended to
    t.wait_attached({"relay r1": "r0"})
    log = t.logs / "relay-r1.log"
    deadline = time.monotonic() + 30
    for who in ("relay r3", "relay r4", "receiver e1"):
        # Attached twice to r1: before the kill and after the restart.
        while log.read_text().count(f"{who} attached") < 2:
            assert time.monotonic() < deadline, f"{who} did not come back to r1:\n{tail(log)}"
            time.sleep(0.05)
    assert "is back; attaching to it again" in (t.logs / "relay-r3.log").read_text()
    t.wait_heard("e1", deadline, after="is back; attaching to it again")
    t.publish_ok(2)
    t.wait_receivers()
    t.assert_exact(2)
    for rid in PLACEMENT:
        v2 = [c for c in t.carried(rid) if c["version"] == 2]
        assert v2 and v2[0]["store_objects"] == 0, f"{rid} needed the store for v2: {v2}\n{tail(t.receivers[rid]['log'])}"
    v2_bytes = t.committed_frame_bytes(2)
    stats = t.stop_relays()
    # The restarted r1 carried v2 to its children (its counters start at the restart).
    out = {link["peer"]: link["bytes_out"] for link in stats["r1"]["links"] if link["kind"] in ("relay", "receiver")}
    for peer in ("r3", "r4", "e1"):
        assert out.get(peer, 0) >= v2_bytes, (peer, out, v2_bytes)
    for rid in ("r3", "r4"):
        assert stats[rid]["upstream"] == t.relays["r1"]["address"], (rid, stats[rid])


def test_frames_of_a_fenced_attempt_are_dropped_by_every_relay(tree):
    t = tree(versions=1)
    start_tree(t, until=1)
    # The first attempt fails once its frames are out (before its manifest): fenced, retried. It stands
    # at that point until the root accepted every frame object of it (a handshake: a fence also drops
    # what the sender has not sent yet).
    accepted = fresh_stats(t, "r0")["accepted"]
    go = t.root / "go-v1"
    p = t.publish(1, extra_env={"DCR_TEST_PAUSE_AT": f"frames-written:{go}", "DCR_TEST_FAIL_AT": "frames-written"})
    wait_logged(p.log, "DCR_TEST_PAUSE_AT: waiting at frames-written")
    (attempt,) = (t.store / "attempts" / f"v{1:010}").iterdir()
    objects = len(list((attempt / "frames").iterdir()))
    assert objects > 0
    deadline = time.monotonic() + TIMEOUT_S
    while fresh_stats(t, "r0")["accepted"] < accepted + objects:
        assert time.monotonic() < deadline, "the root never accepted the attempt's frame objects"
    go.touch()
    report = t.report(p, 1)
    assert report["attempts"] == 2, report
    t.wait_receivers()
    t.assert_exact(1)
    # The store's GC removed the fenced attempt once v1 committed; the relays' logs name it.
    root_log = (t.logs / "relay-r0.log").read_text()
    fenced = sorted({line.split("attempt ", 1)[1].split(" ", 1)[0] for line in root_log.splitlines()
                     if " fenced: " in line})
    assert len(fenced) == 1 and fenced[0].startswith(f"attempts/v{1:010}/0000-"), (fenced, report)
    assert report["attempt"].startswith("0001-"), report
    prefix = fenced[0]
    for rid in RELAYS:
        log = (t.logs / f"relay-{rid}.log").read_text()
        assert f"attempt {prefix} fenced: " in log, f"{rid} did not drop the fenced attempt:\n{log}"
    # The root had every object of it; a relay below may have got fewer (what its parent had not sent
    # yet is dropped from the parent's queue).
    dropped = int(root_log.split(f"attempt {prefix} fenced: ", 1)[1].split(" ", 1)[0])
    assert dropped == objects, root_log
    # A frame object of the fenced attempt (real frames, under its key), pushed into the root afterwards:
    # refused, never forwarded. Pushed into r1, which has an upstream: the sender itself is refused.
    commit = read_json(t.store / "commits" / f"v{1:010}.json")
    frames = sorted((t.store / "attempts" / f"v{1:010}" / commit["attempt"] / "frames").iterdir())
    assert frames
    before = {rid: fresh_stats(t, rid) for rid in ("r3", "r4")}
    key = prefix + "frames/" + frames[0].name
    res = run_dcr("relay", "push", "--to", t.relays["r0"]["address"], "--object-key", key, "--key", t.sender_key,
                  "--relay-pub", t.relay_pub, frames[0])
    assert res.returncode == 0, str(res)
    wait_logged(t.logs / "relay-r0.log", f"refused object {key} of a fenced attempt")
    res = run_dcr("relay", "push", "--to", t.relays["r1"]["address"], "--object-key", key, "--key", t.sender_key,
                  "--relay-pub", t.relay_pub, frames[0])
    assert res.returncode != 0, str(res)
    wait_logged(t.logs / "relay-r1.log", "this relay has an upstream; senders push to the tree's roots")
    stats = t.stop_relays()
    assert stats["r0"]["dropped_fenced"] == 1 and stats["r1"]["dropped_fenced"] == 0, (stats["r0"], stats["r1"])
    for rid in RELAYS:  # what each still holds: the retry's objects alone
        assert stats[rid]["cached_objects"] == len(frames), (rid, stats[rid], len(frames))
    for rid in ("r3", "r4"):
        assert stats[rid]["accepted_bytes"] == before[rid]["accepted_bytes"], (rid, stats[rid], before[rid])
        assert stats[rid]["cached_objects"] == before[rid]["cached_objects"]
    for rid in PLACEMENT:  # nobody applied the fenced attempt: one applied attempt each, the retry
        assert [c["version"] for c in t.carried(rid)] == [1], (rid, t.carried(rid))


def test_a_slow_childs_backlog_is_spooled(tree):
    # The child is stopped (SIGSTOP) until the root holds every frame object of
    # the version: beyond its credit window (16 KiB) and the cache (24 KiB),
    # the backlog can only be on disk, whatever the machine's speed. Silence
    # limits are long enough for the stop (a handshake, not a race).
    t = tree(versions=1)
    t.plan(["r0"], 2)
    t.publish_ok(0, relay=False)
    spool = t.root / "spool"
    t.start_relay("r0", extra=("--link-mbps", "1", "--cache", "24KiB", "--window", "16KiB", "--spool", spool),
                  dead_after="60")
    t.start_receiver("e0", "r0", 1, dead_after="60")
    t.wait_registered()
    t.wait_attached({"receiver e0": "r0"})
    child = t.receivers["e0"]["proc"]
    child.send_signal(signal.SIGSTOP)
    try:
        p = t.publish(1, segment="8KiB", heartbeat_timeout="120")
        attempts = t.store / "attempts" / f"v{1:010}"
        deadline = time.monotonic() + TIMEOUT_S  # a guard only
        while True:  # every frame object is in the store (the manifest comes after them) and at the root
            manifests = list(attempts.glob("*/manifest.bin")) if attempts.exists() else []
            if manifests:
                written = sum(f.stat().st_size for f in (manifests[0].parent / "frames").iterdir())
                if fresh_stats(t, "r0")["accepted_bytes"] == written:
                    break
            assert p.poll() is None and time.monotonic() < deadline, tail(p.log)
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGCONT)
    assert p.wait(timeout=TIMEOUT_S) == 0, tail(p.log)
    t.wait_receivers()
    t.assert_exact(1)
    payload = t.committed_frame_bytes(1)
    c = t.carried("e0")
    assert c and c[0]["store_objects"] == 0 and c[0]["relayed"] == c[0]["total"], c
    stats = t.stop_relays()["r0"]
    assert stats["spooled"] > 0 and stats["unspooled"] == stats["spooled"], stats
    assert stats["spool_full"] == 0 and stats["spool_bytes_in_use"] == 0, stats
    assert [link["evicted"] for link in stats["links"] if link["peer"] == "e0"] == [0], stats
    assert stats["spooled_bytes"] > payload // 2, (stats, payload)  # most of the attempt waited on disk
    assert list(spool.iterdir()) == [], "spool files left behind"
    print(f"spool: {stats['spooled']} objects ({stats['spooled_bytes']} of {payload} bytes) went through the spool")


def test_a_local_tree_in_one_command(tree):
    t = tree(versions=1)
    plan = t.plan(["r0", "r1", "r2"], 2)
    plan_file = t.root / "plan.json"
    plan_file.write_text(json.dumps(plan))
    t.publish_ok(0, relay=False)
    d = t.root / "local"
    args = [str(DCR_BIN), "relay", "tree", "--plan", str(plan_file), "--dir", str(d), "--key", str(t.relay_key),
            "--allow", str(t.allow), "--relay-pub", str(t.relay_pub), "--ping", PING, "--dead-after", DEAD_AFTER]
    # An allow list that admits the receivers' key as a sender is refused before anything starts.
    bad_allow = t.root / "allow-receivers-as-senders"
    bad_allow.write_text(t.allow.read_text() + f"sender {t.client_key.with_suffix('.pub').read_text().strip()}\n")
    bad = [a if a != str(t.allow) else str(bad_allow) for a in args]
    res = subprocess.run(bad + ["--store", t.url, "--receivers", "1", "--until", "1", "--relay-key", str(t.client_key)],
                         capture_output=True, text=True, env=env(), timeout=TIMEOUT_S)
    assert res.returncode != 0 and "admits the receivers' key" in res.stderr and not (d / "logs").exists(), res
    out = t.root / "tree.out"
    with open(out, "wb") as f:
        p = subprocess.Popen(args + ["--store", t.url, "--receivers", "4", "--until", "1", "--relay-key",
                                     str(t.client_key)], stdout=f, stderr=subprocess.STDOUT, env=env())
    t.procs.append(p)
    deadline = time.monotonic() + 30

    def relay_logs() -> str:
        return "".join(q.read_text() for q in (d / "logs").glob("relay-*.log"))

    # r1 and r2 attached to r0, the 4 receivers to their relays and registered in the store.
    while relay_logs().count(" attached: ") < 2 + 4 or len(list((t.store / "receivers").glob("e*.json"))) < 4:
        assert p.poll() is None and time.monotonic() < deadline, out.read_text() + relay_logs()
        time.sleep(0.05)
    for log in sorted((d / "logs").glob("follow-*.log")):  # each receiver heard from its relay
        wait_logged(log, "attached to relay")
    t.publish_ok(1)
    assert p.wait(timeout=TIMEOUT_S) == 0, out.read_text()
    text = out.read_text()
    assert "every receiver reached version 1" in text and "stopped 7 processes" in text, text
    for i in range(4):
        res = run_dcr("diff", "--json", "--summary", t.gen / "v1", d / f"target-e{i}")
        assert res.returncode == 0, (i, res)
        log = (d / "logs" / f"follow-e{i}.log").read_text()
        assert "from the relay, 0 (0 bytes) from the store" in log, log
    stats = sorted(d.glob("stats-*.json"))
    shown = run_dcr("status", "--store", t.url, "--relay-stats", *stats)
    assert shown.returncode == 0, str(shown)
    assert "relay tree (from 3 stats files)" in shown.stdout, shown.stdout
    assert f"relay r1 at {t.relays['r1']['address']}, upstream r0 {t.relays['r0']['address']}" in shown.stdout
    assert "-> receiver e1" in shown.stdout and "-> relay r2" in shown.stdout, shown.stdout
    as_json = run_dcr("status", "--store", t.url, "--json", "--relay-stats", *stats).json()
    assert sorted(r["id"] for r in as_json["relays"]) == ["r0", "r1", "r2"], as_json
    payload = t.committed_frame_bytes(1)
    for r in as_json["relays"]:
        for link in r["links"]:
            if link["kind"] == "receiver":
                assert link["bytes_out"] == payload, (r["id"], link)

    # Without --until: SIGINT stops every child.
    with open(out, "wb") as f:
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env())
    t.procs.append(p)
    while "3 relays, 0 receivers" not in out.read_text():
        assert p.poll() is None and time.monotonic() < deadline + 30, out.read_text()
        time.sleep(0.05)
    pids = [int(line.split("(pid ", 1)[1].split(",", 1)[0]) for line in out.read_text().splitlines() if "(pid " in line]
    assert len(pids) == 3
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=20) == 0, out.read_text()
    assert "stopped 3 processes (signal)" in out.read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_engine_ranks_take_their_frames_from_the_relay(tree):
    """Two ranks of a tensor-parallel engine (`dcr follow --layout`) below one
    relay: the version's frame objects reach both through the relay, none from
    the store, their partial acks go to the store, the engine commits, and
    each rank's buffer files equal a dense load of the checkpoint through its
    map (`dcr layout load`), compared as plain bytes."""
    t = tree()
    maps = {}
    for r in range(2):
        maps[r] = t.root / f"map-r{r}.json"
        res = run_dcr("layout", "generate", "--side", "vllm", "--family", "qwen3-moe", "--size", SIZE, "--tp", 2,
                      "--rank", r, "-o", maps[r])
        assert res.returncode == 0, str(res)
    t.plan(["r0"], 1)
    t.publish_ok(0, relay=False)
    t.start_relay("r0")
    for r in range(2):
        t.start_receiver(f"tp-r{r}", "r0", until=1, rank=(maps[r], "tp", r, 2))
    t.wait_registered()
    t.wait_attached({f"receiver tp-r{r}": "r0" for r in range(2)})
    report = t.publish_ok(1)
    assert report["version"] == 1
    t.wait_receivers()
    for r in range(2):
        rid = f"tp-r{r}"
        carried = t.carried(rid)
        assert [c["version"] for c in carried] == [1], tail(t.receivers[rid]["log"])
        assert carried[0]["relayed"] == carried[0]["total"] > 0 and carried[0]["store_objects"] == 0, carried
        dense = t.root / f"dense-r{r}"
        res = run_dcr("layout", "load", t.gen / "v1", maps[r], "-o", dense)
        assert res.returncode == 0, str(res)
        target = t.receivers[rid]["target"]
        got = {p.name: p.read_bytes() for p in sorted(target.iterdir()) if p.is_file() and not p.name.startswith(".")}
        want = {p.name: p.read_bytes() for p in sorted(dense.iterdir()) if p.is_file()}
        assert got.keys() == want.keys() and got == want, f"rank {r}'s buffers differ from a dense load of v1"
        ack = read_json(t.store / "attempts" / "v0000000001" / read_json(t.store / "commits" / "v0000000001.json")["attempt"]
                        / "acks" / f"{rid}.json")
        assert ack and ack["ok"] and ack["engine"] == {"id": "tp", "rank": r, "ranks": 2}, ack


def test_python_followers_take_their_frames_from_the_relay(tree):
    """The Python package's receivers take a relay too: a `dcr.Follower` and
    a `dcr.Receiver` (rank 0 of 1, live torch tensors) below one relay, with
    CURVE keys. Every frame object reaches both through the relay (the
    relay's links to them carry the payload), the whole receiver's ack comes
    up the tree, and both end exact: the checkpoint by `dcr diff`, the tensors
    against the checkpoint's, compared as bytes."""
    import threading

    import torch
    from safetensors.torch import load_file

    import dcr
    t = tree(versions=1)
    t.plan(["r0"], 1)
    t.publish_ok(0, relay=False)
    t.start_relay("r0")
    addr = t.relays["r0"]["address"]
    # A backstop of an hour: between looks the publisher's notices decide when to look.
    keys = dict(relay=[addr], relay_key=t.client_key, relay_pub=t.relay_pub, relay_poll_s=3600)
    store = dcr.open_store(t.url)
    follower = dcr.Follower(store, t.root / "py-follower", id="py-follower", poll_s=0.05, **keys)
    def tensors(v: int) -> dict:
        out = {}
        for f in sorted((t.gen / f"v{v}").glob("*.safetensors")):
            out.update(load_file(f))
        return out

    live = {name: torch.empty_like(x) for name, x in tensors(0).items()}
    receiver = dcr.Receiver(live)
    results, errors = {}, []

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append((name, e))

    threads = [threading.Thread(target=run, args=("follower", lambda: follower.run(until=1, timeout_s=TIMEOUT_S))),
               threading.Thread(target=run, args=("receiver", lambda: receiver.follow(
                   store, t.root / "py-rank", engine="py", until=1, timeout_s=TIMEOUT_S, poll_s=0.05, **keys)))]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 30
    for rid in ("py-follower", "py-r0"):
        while not ((rec := read_json(t.store / "receivers" / f"{rid}.json")) and rec.get("state") == "following"):
            assert not errors and time.monotonic() < deadline, (rid, errors)
            time.sleep(0.05)
    t.wait_attached({"receiver py-follower": "r0", "receiver py-r0": "r0"})
    report = t.publish_ok(1)
    for th in threads:
        th.join(timeout=TIMEOUT_S)
    assert not errors and results == {"follower": 1, "receiver": 1}, (results, errors)
    assert report["relay_acks"] == 1 and sorted(report["acked"]) == ["py-follower", "py-r0"], report
    res = run_dcr("diff", "--json", "--summary", t.gen / "v1", t.root / "py-follower")
    assert res.returncode == 0, str(res)
    for name, x in tensors(1).items():
        assert live[name].view(torch.uint8).equal(x.view(torch.uint8)), f"tensor {name} differs from v1"
    payload = t.committed_frame_bytes(1)
    stats = t.stop_relays()
    out = {link["peer"]: link["bytes_out"] for link in stats["r0"]["links"] if link["kind"] == "receiver"}
    assert out == {"py-follower": payload, "py-r0": payload}, (out, payload)


def test_a_root_pulls_from_the_store(tree):
    t = tree(versions=2)
    t.start_chain(["r0", "r1"], {"e0": "r0", "e1": "r1"}, 2, relay_extra={"r0": ("--pull-store", t.url)},
                  attached=(("sender store-puller-r0", "r0"),))
    t.publish_ok(1, relay=False)
    # v2's first attempt fails after its frames are in the store: fenced there, dropped by the relays.
    report = t.publish_ok(2, relay=False, extra_env={"DCR_TEST_FAIL_AT": "frames-written"})
    assert report["attempts"] == 2, report
    t.wait_receivers()
    t.assert_exact(2)
    for rid in ("e0", "e1"):
        c = t.carried(rid)
        assert [x["version"] for x in c] == [1, 2], (rid, c)
        assert all(x["store_objects"] == 0 and x["relayed"] == x["total"] for x in c), (rid, c)
    payload = t.committed_frame_bytes(1) + t.committed_frame_bytes(2)
    stats = t.stop_relays()
    pulled = [link for link in stats["r0"]["links"] if link["kind"] == "sender"]
    assert [link["peer"] for link in pulled] == ["store-puller-r0"], pulled
    # Into the cluster: the root's reads of the store, each committed object once (plus the fenced attempt's).
    assert pulled[0]["bytes_in"] >= payload and stats["r0"]["duplicates"] == 0, (pulled, payload)
    for rid in ("r0", "r1"):
        assert " fenced: " in (t.logs / f"relay-{rid}.log").read_text(), rid
        # The puller's notices (at least each commit it read: v0 at its start, v1, v2) pass down the chain.
        assert stats[rid]["notices"] >= 3, (rid, stats[rid]["notices"])


def test_unauthenticated_clients_are_refused(tree):
    t = tree(versions=1)
    t.plan(["r0"], 2)
    t.publish_ok(0, relay=False)
    t.start_relay("r0")
    t.start_receiver("good", "r0", 1)
    t.start_receiver("stranger", "r0", 1, key=t.stranger_key)
    t.start_receiver("keyless", "r0", 1, no_keys=True)
    t.wait_registered()
    t.wait_attached({"receiver good": "r0"})
    t.publish_ok(1)
    t.wait_receivers()
    t.assert_exact(1)
    good = t.carried("good")
    assert good and good[0]["store_objects"] == 0, good
    for rid in ("stranger", "keyless"):
        c = t.carried(rid)
        assert c and c[0]["relayed"] == 0 and c[0]["store_objects"] == c[0]["total"] > 0, (rid, c)
        assert "relay: 0 objects (0 bytes) received" in t.receivers[rid]["log"].read_text()
    log = (t.logs / "relay-r0.log").read_text()
    stranger_pub = (t.stranger_key.with_suffix(".pub")).read_text().strip()
    assert f"(CURVE key {stranger_pub}): not in the allow list" in log, log
    assert "handshake failed" in log, log
    stats = t.stop_relays()
    assert stats["r0"]["refused_peers"] >= 2
    assert [link["peer"] for link in stats["r0"]["links"] if link["kind"] == "receiver"] == ["good"]


def test_a_corrupt_frame_is_dropped_never_forwarded(tree):
    t = tree(versions=1)
    # A chain r0 <- r1 <- r2; the second object is damaged on arrival at r0.
    t.start_chain(["r0", "r1", "r2"], {"e0": "r1", "e1": "r2"}, 1, relay_env={"r0": {"DCR_TEST_CORRUPT_NTH": "2"}})
    t.publish_ok(1)
    t.wait_receivers()
    t.assert_exact(1)
    payload = t.committed_frame_bytes(1)
    for rid in ("e0", "e1"):
        c = t.carried(rid)
        assert c and c[0]["store_objects"] == 1 and c[0]["relayed"] == c[0]["total"] - 1, (rid, c)
    assert "dropped a corrupt object from sender" in (t.logs / "relay-r0.log").read_text()

    # A real frame object, damaged inside a frame (its envelope CRC is right),
    # pushed into the root by an authenticated sender (objects enter the tree at its roots).
    commit = read_json(t.store / "commits" / f"v{1:010}.json")
    frames = sorted((t.store / "attempts" / f"v{1:010}" / commit["attempt"] / "frames").iterdir())
    damaged = bytearray(frames[0].read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    bad = t.root / "damaged.bin"
    bad.write_bytes(bytes(damaged))
    key = f"attempts/v{1:010}/{commit['attempt']}/frames/s9-0000.bin"
    res = run_dcr("relay", "push", "--to", t.relays["r0"]["address"], "--object-key", key, "--key", t.sender_key,
                  "--relay-pub", t.relay_pub, bad)
    assert res.returncode == 0, str(res)
    wait_logged(t.logs / "relay-r0.log", f"frame object {key}: the frame at offset")
    stats = t.stop_relays()
    assert stats["r0"]["dropped_corrupt"] == 2
    assert stats["r1"]["dropped_corrupt"] == 0
    r0_out = sum(link["bytes_out"] for link in stats["r0"]["links"] if link["kind"] == "relay")
    assert r0_out == stats["r0"]["accepted_bytes"] < payload  # the damaged object never left r0
    assert sum(link["bytes_in"] for link in stats["r2"]["links"] if link["kind"] == "upstream") == \
        stats["r1"]["accepted_bytes"] == r0_out  # nor r1
    assert stats["r2"]["dropped_corrupt"] == 0


@pytest.mark.parametrize("relay_reads_store", [False, True], ids=["receiver-verifies", "relay-verifies"])
def test_a_forged_object_pushed_ahead_of_the_publisher_is_refused(tree, relay_reads_store):
    """Forged copies pushed with a sender's key: a relay without the store keeps the first copy of a key
    and the receiver refuses it (the store's copy is applied); a relay given the store (--store) refuses
    them itself, keeps the publisher's copies, and the receiver gets every object from the tree."""
    t = tree(versions=2)
    t.plan(["r0"], 2)
    t.publish_ok(0, relay=False)
    t.start_relay("r0", extra=("--store", t.url) if relay_reads_store else ())
    t.start_receiver("victim", "r0", 1)
    t.wait_registered()
    t.wait_attached({"receiver victim": "r0"})
    pub, go, attempt_dir = t.publish_paused(1, "attempt-opened")
    attempt = attempt_dir.name
    # The attacker's bits: v2 against the v0 the victim holds, in the run's chunking (well-formed
    # frames: only the signature tells them from the publisher's).
    res = run_dcr("delta", "make", t.gen / "v0", t.gen / "v2", "-o", t.root / "attacker", "--chunk", CHUNK)
    assert res.returncode == 0, str(res)
    frames = (t.root / "attacker" / "frames.bin").read_bytes()
    made_up = b"DCRS\x01\x01\x00\x00" + bytes(range(64))  # a trailer whose signature is nobody's
    forged = {"s0-0000": frames, "s1-0000": frames + made_up}
    for name, data in forged.items():
        (t.root / f"forged-{name}.bin").write_bytes(data)

    def push(name: str, key: Path):
        return run_dcr("relay", "push", "--to", t.relays["r0"]["address"], "--object-key",
                       f"attempts/v{1:010}/{attempt}/frames/{name}.bin", "--key", key, "--relay-pub", t.relay_pub,
                       t.root / f"forged-{name}.bin")

    # The receivers' key is not a sender's: refused at the relay.
    res = push("s0-0000", t.client_key)
    assert res.returncode != 0, str(res)
    client_pub = t.client_key.with_suffix(".pub").read_text().strip()
    wait_logged(t.logs / "relay-r0.log",
                f"refused HELLO as sender push (CURVE key {client_pub}): the allow list admits that key as receiver")
    wait_logged(t.logs / "relay-r0.log", "did not say HELLO as a sender sent an object: refused")
    # A sender's key gets them into the relay, ahead of the publisher's.
    for name in forged:
        res = push(name, t.sender_key)
        assert res.returncode == 0, str(res)
    if relay_reads_store:
        for name in forged:
            wait_logged(t.logs / "relay-r0.log", f"refused object attempts/v0000000001/{attempt}/frames/{name}.bin "
                                                 "from sender push")
    else:
        wait_logged(t.receivers["victim"]["log"],
                    "frame object attempts/v0000000001/" + attempt + "/frames/s1-0000.bin")
    go.touch()
    report = t.report(pub, 1)
    t.wait_receivers()
    t.assert_exact(1)
    assert report["attempts"] == 1 and report["acked"] == ["victim"], report
    log = t.receivers["victim"]["log"].read_text()
    if relay_reads_store:
        assert "refused an object the relay delivered" not in log, log
        (carried,) = t.carried("victim")
        assert carried["store_objects"] == 0 and carried["relayed"] == carried["total"], carried
        stats = t.stop_relays()
        assert stats["r0"]["dropped_unverified"] == 2, stats["r0"]
        return
    assert "frames/s0-0000.bin: not signed" in log, log
    assert "frames/s1-0000.bin: its signature is not by the attempt's publisher" in log, log
    (carried,) = t.carried("victim")
    assert carried["store_objects"] >= 2, carried  # the two keys the relay holds forged copies of
    stats = t.stop_relays()
    assert stats["r0"]["duplicates"] >= 2, stats["r0"]  # the publisher's copies of those two keys


def test_plain_tcp_only_when_asked(tmp):
    # Keys are the default: a relay or a client without them is refused with the way forward.
    address = free_address()
    obj = tmp / "object.bin"
    obj.write_bytes(b"x")
    # Each names its own flags (a relay's --key/--insecure, a client's --relay-key/--relay-insecure).
    for args, flags in ((["relay", "--id", "r", "--listen", address], ("--key", "--insecure")),
                        (["follow", "--store", f"file://{tmp}/store", "--until", "0", tmp / "target", "--relay",
                          address], ("--relay-key", "--relay-insecure")),
                        (["publish", "--store", f"file://{tmp}/store", "--version", "0", tmp / "none", "--relay",
                          address], ("--relay-key", "--relay-insecure")),
                        (["relay", "push", "--to", address, "--object-key",
                          "attempts/v0000000001/0000-0123abcd/frames/s0-0000.bin", obj], ("--key", "--insecure"))):
        res = run_dcr(*args)
        assert res.returncode != 0 and "authenticated by default" in res.stderr, str(res)
        key, insecure = flags
        assert f"key pair ({key};" in res.stderr and f"ask for {insecure} (plain TCP)" in res.stderr, res.stderr
    # Asked for: it runs, and says what it is at start.
    log = tmp / "insecure-relay.log"
    with open(log, "wb") as out:
        p = subprocess.Popen([str(DCR_BIN), "relay", "--id", "r", "--listen", address, "--insecure"], stdout=out,
                             stderr=subprocess.STDOUT, env=env())
    try:
        wait_logged(log, "WARNING: insecure relay link (plain TCP)")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0, log.read_text()


def vm_kib(pid: int, field: str) -> int:
    """A process's VmSize / VmRSS in KiB (/proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def zmtp_null_dealer(address: str) -> socket.socket:
    """A raw TCP peer that completes ZMTP 3.0's NULL handshake as a DEALER, so that a test can
    then write frames no ZeroMQ library would send."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31))
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        assert chunk, "the relay closed the connection during the greeting"
        got += chunk
    props = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    body = b"\x05READY" + props
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def test_oversized_and_many_part_messages_leave_the_relay_up_and_small(tmp):
    """A message declaring 16 GiB (the relay once reserved 16.9 GB for it) and one of 200,000
    parts: the relay drops both, stays up, serves on, and its memory stays within bounds."""
    address, stats = free_address(), tmp / "stats.json"
    log = tmp / "relay.log"
    with open(log, "wb") as out:
        p = subprocess.Popen([str(DCR_BIN), "relay", "--id", "r", "--listen", address, "--insecure", "--stats",
                              str(stats)], stdout=out, stderr=subprocess.STDOUT, env=env())
    try:
        wait_logged(log, "listening on")
        size0, rss0 = vm_kib(p.pid, "VmSize"), vm_kib(p.pid, "VmRSS")
        # 16 GiB declared in a ZMTP long frame header, then nothing: ZMQ_MAXMSGSIZE drops the peer.
        s = zmtp_null_dealer(address)
        s.sendall(b"\x02" + struct.pack(">Q", 16 << 30))
        s.settimeout(30)
        assert s.recv(1 << 16) == b"" or s.recv(1 << 16) == b"", "the relay kept a peer that declared 16 GiB"
        s.close()
        # 200,000 parts in one message, from a real ZeroMQ peer.
        import zmq
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.connect(address)
        d.send_multipart([b"x"] * 200_000)
        deadline = time.monotonic() + 60
        while (read_json(stats) or {}).get("malformed", 0) < 1:
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert p.poll() is None, log.read_text()
        grown_size, grown_rss = vm_kib(p.pid, "VmSize") - size0, vm_kib(p.pid, "VmRSS") - rss0
        print(f"relay memory after both: VmSize +{grown_size} KiB, VmRSS +{grown_rss} KiB")
        assert grown_size < 256 << 10 and grown_rss < 128 << 10, (grown_size, grown_rss)
        assert "ignored a malformed message from a peer" in log.read_text(), log.read_text()
        # Still serving: a HELLO (docs/relay.md, wire messages) on the same connection attaches.
        hello = struct.pack("<IBBH", 0x4C524344, 1, 1, 0) + b"\x02" + struct.pack("<H", 5) + b"alive" + \
            struct.pack("<I", 0)
        d.send(hello)
        wait_logged(log, "receiver alive attached")
        d.close(linger=0)
        ctx.term()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0, log.read_text()


def relay_message(kind: int, body: bytes) -> bytes:
    """A wire message's single part (docs/relay.md): magic, version 1, type, reserved, body."""
    return struct.pack("<IBBH", 0x4C524344, 1, kind, 0) + body


def wire_str(s: str) -> bytes:
    return struct.pack("<H", len(s)) + s.encode()


def test_a_receivers_key_cannot_forge_acks_or_fence(tree):
    """A peer with the receivers' key (allow-listed as a receiver) attaches to the root and, while
    the publisher stands after its manifest (DCR_TEST_PAUSE_AT), sends an ACK with a forged ok=1 for
    a receiver id that never acked and a forged nack for the real receiver, and a FENCE of the
    attempt: the fence is refused and logged, the attempt commits first time, and the commit lists
    exactly the receiver that acked in the store. A peer with another key (the relays') saying HELLO
    under the real receiver's id is refused, and the receiver keeps its place."""
    import zmq
    t = tree(versions=1)
    t.plan(["r0"], 2)
    t.publish_ok(0, relay=False)
    t.start_relay("r0")
    t.start_receiver("good", "r0", 1)
    t.wait_registered()
    t.wait_attached({"receiver good": "r0"})
    pub, go, attempt_dir = t.publish_paused(1, "manifest-written")
    attempt = attempt_dir.name
    prefix = f"attempts/v{1:010}/{attempt}/"
    target = stored_manifest(attempt_dir)["target_digest"]
    lane0, lane1 = int(target[:16], 16), int(target[16:], 16)

    keys = dict(line.split(" ", 1) for line in t.client_key.read_text().splitlines() if not line.startswith("#"))
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.curve_publickey, peer.curve_secretkey = keys["public"].encode(), keys["secret"].encode()
    peer.curve_serverkey = t.relay_pub.read_text().strip().encode()
    peer.connect(t.relays["r0"]["address"])
    try:
        peer.send(relay_message(1, b"\x02" + wire_str("mallory") + struct.pack("<I", 0)))  # HELLO as a receiver
        wait_logged(t.logs / "relay-r0.log", "receiver mallory attached")
        entries = [("ghost", 1, lane0, lane1, ""), ("good", 0, 0, 0, "forged: apply failed")]
        body = wire_str(prefix) + struct.pack("<I", len(entries)) + b"".join(
            wire_str(r) + struct.pack("<BQQ", ok, a, b) + wire_str(e) for r, ok, a, b, e in entries)
        peer.send(relay_message(6, body))  # ACK
        peer.send(relay_message(4, wire_str(prefix)))  # FENCE
        wait_logged(t.logs / "relay-r0.log", "a peer that is not an attached sender sent a fence: refused")
        wait_logged(t.logs / "relay-r0.log", f"receiver good (via receiver mallory) failed attempt {prefix}")
        # Another key cannot take the real receiver's id (which would evict it from the relay).
        relay_keys = dict(line.split(" ", 1) for line in t.relay_key.read_text().splitlines()
                          if not line.startswith("#"))
        impostor = ctx.socket(zmq.DEALER)
        impostor.curve_publickey, impostor.curve_secretkey = (relay_keys["public"].encode(),
                                                              relay_keys["secret"].encode())
        impostor.curve_serverkey = t.relay_pub.read_text().strip().encode()
        impostor.connect(t.relays["r0"]["address"])
        impostor.send(relay_message(1, b"\x01" + wire_str("good") + struct.pack("<I", 0)))  # HELLO as a relay
        wait_logged(t.logs / "relay-r0.log", "refused HELLO as relay good (CURVE key "
                                             f"{relay_keys['public']}): a child of that id is attached with another key")
        impostor.close(linger=0)
    finally:
        go.touch()
    report = t.report(pub, 1)
    peer.close(linger=0)
    ctx.term()
    t.wait_receivers()
    t.assert_exact(1)
    assert report["attempts"] == 1 and report["acked"] == ["good"], report
    assert report["relay_acks_unconfirmed"] >= 1, report  # ghost's, at least (good's forged nack may have met its real ack)
    commit = read_json(t.store / "commits" / f"v{1:010}.json")
    assert commit["attempt"] == attempt and commit["acked"] == ["good"], commit
    assert f"attempt {prefix} fenced" not in (t.logs / "relay-r0.log").read_text()
