"""A failure campaign for the relay tree (issue 20): the tree of
test_relay.py (5 relays, fanout 2, depth 2; 8 receivers below them; a
file:// store as the control plane), and episode after episode a version
published through it while a relay is hurt:

  relay:kill       kill -9 of a random relay while the version streams; it
                   stays down through the episode (restarted on its address
                   before the next one)
  relay:restart    kill -9 of a random relay while the version streams, and
                   restarted on the same address at once
  relay:partition  a random relay stopped (SIGSTOP) while the version streams,
                   for up to twice the dead-after time, then continued: cut
                   off from its parent and children with its connections
                   open, as a partition does, then healed

After each episode: the version is committed (clean re-runs allowed), every
receiver reaches it and is byte for byte the dense checkpoint (`dcr diff`),
no commit record changed, and no version has two committed attempts.

Runs when DCR_CAMPAIGN_RELAY_EPISODES is set (scripts/soak.sh sets it);
DCR_CAMPAIGN_SEED replays a run (the kinds, victims and delays; a kill lands
where the clock puts it); DCR_CAMPAIGN_REPORT writes its JSON lines
(campaign_report.py); DCR_CAMPAIGN_TIME_BOUND_S overrides the time bound.

  DCR_CAMPAIGN_RELAY_EPISODES=12 .venv/bin/python -m pytest -s tests/python/test_relay_campaign.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter

import pytest
from campaign_report import CampaignReport, CampaignSettings
from conftest import run_dcr
from test_relay import DEAD_AFTER, PLACEMENT, RELAYS, TIMEOUT_S, Tree, read_json, start_tree, tail

RELAY_KINDS = ["relay:kill", "relay:restart", "relay:partition"]
GEN_VERSIONS = 4  # versions above it reuse them: v5 is v1's bits, v6 v2's, ...


@pytest.fixture
def relay_tree(tmp):
    made = []

    def make(versions: int) -> Tree:
        t = Tree(tmp / "tree", versions=versions)
        made.append(t)
        return t

    yield make
    for t in made:
        for p in t.relay_procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
        t.kill_all()


class RelayCampaign:
    def __init__(self, t: Tree, seed: int, report: CampaignReport):
        self.t, self.seed, self.report = t, seed, report
        self.rng = random.Random(seed)
        self.faults: Counter = Counter()
        self.commits_seen: dict[int, bytes] = {}
        self.reruns = 0
        self.publish_runs = 0

    def alive(self, rid: str) -> bool:
        return self.t.relay_procs[rid].poll() is None

    def heal(self) -> None:
        """Every relay running again (a killed one restarted on its address)."""
        for rid in RELAYS:
            p = self.t.relay_procs[rid]
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
            else:
                self.t.start_relay(rid)

    def episode(self, n: int, v: int, kind: str) -> None:
        t, rng = self.t, self.rng
        start = time.monotonic()
        before = Counter(self.faults)
        victim = rng.choice(RELAYS)
        # Small segments and a slow store (each operation sleeps up to 10 ms)
        # make the version stream for seconds: the fault lands inside it.
        p = t.publish(v, segment="8KiB", extra_env={"DCR_STORE_FAULTS": f"seed={rng.randrange(1 << 30)},delay_ms=10"})
        self.publish_runs += 1
        time.sleep(rng.uniform(0.1, 1.0))
        during = p.poll() is None
        proc = t.relay_procs[victim]
        if kind in ("relay:kill", "relay:restart"):
            proc.kill()
            proc.wait()
            if kind == "relay:restart":
                t.start_relay(victim)
            detail = f"{'killed' if kind == 'relay:kill' else 'restarted'} {victim}"
        elif kind == "relay:partition":
            hold = rng.uniform(0.2, 2 * float(DEAD_AFTER))
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(hold)
            os.kill(proc.pid, signal.SIGCONT)
            detail = f"{victim} cut off for {hold:.1f} s"
        else:
            raise ValueError(kind)
        detail += " while v streamed" if during else " after the publish ended"
        self.faults[kind] += 1
        try:
            rc = p.wait(timeout=TIMEOUT_S)
        except Exception as e:
            raise AssertionError(f"publish v{v} hung for {TIMEOUT_S} s:\n{tail(p.log)}") from e
        reruns = 0
        while rc != 0 or read_json(t.store / "commits" / f"v{v:010}.json") is None:
            reruns += 1
            self.reruns += 1
            assert reruns < 4, f"version {v} did not commit after {reruns} clean re-runs:\n{tail(p.log)}"
            p = t.publish(v)
            self.publish_runs += 1
            rc = p.wait(timeout=TIMEOUT_S)
        t_publish = time.monotonic() - start
        if kind == "relay:kill":
            self.heal()  # for the next episode
        self.check(v)
        commit = read_json(t.store / "commits" / f"v{v:010}.json")
        faults = {k: c - before.get(k, 0) for k, c in self.faults.items() if c > before.get(k, 0)}
        self.report.episode(episode=n, version=v, kind=kind, faults=faults, receivers_checked=len(t.receivers),
                            committed=True, attempt=commit["attempt"], retired=commit.get("retired", []),
                            reruns=reruns, seconds=round(time.monotonic() - start, 2), detail=detail)
        print(f"  episode {n:3} v{v:<3} {kind:16} {detail}; publish rc 0"
              f"{f' after {reruns} re-run(s)' if reruns else ''}; committed {commit['attempt']}"
              f" ({t_publish:.1f}/{time.monotonic() - start:.1f} s)", flush=True)

    def check(self, v: int) -> None:
        t = self.t
        deadline = time.monotonic() + TIMEOUT_S
        for rid, r in t.receivers.items():
            while True:
                j = read_json(r["target"] / ".dcr-follow.json")
                if j and j.get("version") == v and not j.get("attempt"):
                    break
                rc = r["proc"].poll()
                assert rc is None or rc == 0, f"receiver {rid} exited (rc {rc}):\n{tail(r['log'])}"
                assert time.monotonic() < deadline, (
                    f"receiver {rid} did not reach version {v} in {TIMEOUT_S} s (journal {j}):\n{tail(r['log'])}")
                time.sleep(0.05)
        t.assert_exact(v)  # every receiver's bits against the dense checkpoint of v
        for p in sorted((t.store / "commits").glob("v*.json")):
            u, data = int(p.name[1:11]), p.read_bytes()
            old = self.commits_seen.setdefault(u, data)
            assert old == data, f"commit record of version {u} changed:\n  {old!r}\n  {data!r}"
        assert max(self.commits_seen) == v, f"newest commit {max(self.commits_seen)}, expected {v}"


def link_versions(t: Tree, upto: int) -> None:
    """gen/vN for N past the generated ones: links to gen/v((N-1) % GEN_VERSIONS + 1)."""
    for n in range(GEN_VERSIONS + 1, upto + 1):
        link = t.gen / f"v{n}"
        if not link.exists():
            link.symlink_to(f"v{(n - 1) % GEN_VERSIONS + 1}")


def test_relay_failure_campaign(relay_tree):
    # The suite runs one round (each kind once); scripts/soak.sh sets the count.
    cs = CampaignSettings("relay", "DCR_CAMPAIGN_RELAY_EPISODES", RELAY_KINDS, lambda n: 120 + 20 * n,
                          "tests/python/test_relay_campaign.py")
    episodes, seed, bound, kinds, replay, report = cs.episodes, cs.seed, cs.bound, cs.kinds, cs.replay, cs.report
    started = time.monotonic()
    n, kind = 0, "start"
    try:
        t = relay_tree(min(episodes, GEN_VERSIONS))
        link_versions(t, episodes)
        start_tree(t, until=episodes)
        c = RelayCampaign(t, seed, report)
        order: list[str] = []
        for n in range(1, episodes + 1):
            if not order:  # every kind once per round, in a seeded order
                order = list(kinds)
                c.rng.shuffle(order)
            kind = order.pop()
            c.episode(n, n, kind)
            assert time.monotonic() - started < bound, (
                f"campaign over its time bound of {bound:.0f} s after {n} episodes (seed {seed})")
        n, kind = n + 1, "final-check"
        c.heal()
        t.wait_receivers()  # each exits 0 at --until
        st = run_dcr("status", "--store", t.url, "--json")
        assert st.returncode == 0, str(st)
        for x in st.json()["versions"]:
            assert sum(a["state"] == "committed" for a in x["attempts"]) <= 1, f"two commits: {x}"
        stats = t.stop_relays()
        counters = {"faults": dict(sorted(c.faults.items())), "faults_total": sum(c.faults.values()),
                    "versions_committed": len(c.commits_seen), "publish_runs": c.publish_runs,
                    "publish_reruns": c.reruns, "relays": len(RELAYS), "receivers": len(PLACEMENT),
                    "relay_duplicates": sum((s or {}).get("duplicates", 0) for s in stats.values()),
                    "relay_dropped_corrupt": sum((s or {}).get("dropped_corrupt", 0) for s in stats.values()),
                    "seed": seed, "episodes": episodes, "seconds": round(time.monotonic() - started, 1)}
    except BaseException as e:
        report.failure(n, kind, e)
        print(f"\nepisode {n} ({kind}) failed; replay with {replay}", flush=True)
        raise
    report.end(episodes, counters)
    print("relay failure campaign counts: " + json.dumps(counters, indent=1), flush=True)
