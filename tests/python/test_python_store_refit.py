"""Live tensors through the store protocol, as real processes. A trainer
process holds a tiny transformers Llama (test_python_refit_models.tiny_llama)
as two senders (its parameters split between two identity maps), publishes
version 0 from them and then three AdamW steps of its live parameters with
dcr.ShardPublisher through a file:// store. Two receiver processes follow
with dcr.Receiver.follow into their own live tensors: one laid out the way
vLLM lays it out (fused qkv_proj / gate_up_proj, its map traced from its
loader), one holding the transformers parameters themselves (identity map).
Both start from other random weights, so they must join from the snapshot.
After each commit every receiver parameter must be byte-identical to a
dense load of the trainer's parameters (saved by the trainer after the
commit). The identity receiver is SIGKILLed after version 1; a new process
with other random weights and the same state directory rejoins and follows
on. Nothing here trusts dcr's digests: the comparison is of saved bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import dcr  # noqa: E402
from conftest import following  # noqa: E402
from test_python_refit_models import FusedLlamaParams, bits, tiny_llama  # noqa: E402

HERE = str(Path(__file__).resolve().parent)
VERSIONS = 3

TRAINER = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, dcr
from safetensors.torch import save_file
from test_python_refit_models import tiny_llama
url, state, out = sys.argv[2:5]
model, cfg = tiny_llama()
live = {n: p.data for n, p in model.named_parameters()}
names = sorted(live)
senders = [{n: live[n] for n in names[0::2]}, {n: live[n] for n in names[1::2]}]
pub = dcr.ShardPublisher(dcr.open_store(url), state, senders, ack_timeout_s=120, heartbeat_timeout_s=120,
                         chunk_elements=512)
def save(v):
    save_file({n: t.clone() for n, t in live.items()}, f"{out}/trainer-v{v}.safetensors")
    print("committed", v, flush=True)
pub.publish_snapshot(live)
save(0)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
gen = torch.Generator().manual_seed(1)
for v in range(1, int(sys.argv[5]) + 1):
    sys.stdin.readline()  # the test says when
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    report = pub.publish(v)
    assert sorted(report["acked"]) == ["fused-r0", "hf-r0"], report
    save(v)
"""

RECEIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, dcr
from dcr.trace import record_layout
from safetensors.torch import save_file
from test_python_refit_models import FusedLlamaParams, tiny_llama
url, state, out, kind, seed, until = sys.argv[2:8]
model, cfg = tiny_llama()
gen = torch.Generator().manual_seed(int(seed))
with torch.no_grad():
    for p in model.parameters():  # not the trainer's weights: the receiver must join
        p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
canonical = {n: p.data for n, p in model.named_parameters()}
if kind == "fused":
    engine = FusedLlamaParams(cfg)
    layout, residuals = record_layout(engine.params, engine.load_weights, canonical)
    assert residuals == []
    params = engine.params
else:
    layout, params = None, canonical
ptrs = {n: p.data_ptr() for n, p in params.items()}
def dump(report):
    v = report["version"]
    assert all(p.data_ptr() == ptrs[n] for n, p in params.items()), "a parameter was replaced"
    save_file({n: p.clone() for n, p in params.items()}, f"{out}/{kind}-v{v}.safetensors")
    print("version", v, flush=True)
receiver = dcr.Receiver(params, layout, post_update=dump)
held = receiver.follow(dcr.open_store(url), state, engine=kind, until=int(until), timeout_s=60, poll_s=0.02,
                       quiet=False)
assert held == int(until) == receiver.version
"""


def test_trainer_and_two_receivers_refit_live_tensors_through_a_store(tmp_path):
    store_url = f"file://{tmp_path}/store"
    out = tmp_path / "out"
    out.mkdir()
    procs: list[subprocess.Popen] = []

    def spawn(script, *args, stdin=None, log=None):
        # One thread each: three processes share the test machine's cores.
        p = subprocess.Popen([sys.executable, "-c", script, HERE, store_url, *map(str, args)], stdin=stdin,
                             stdout=subprocess.PIPE, stderr=open(log, "w") if log else None, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append(p)
        return p

    def receiver(kind, seed, life):
        return spawn(RECEIVER, tmp_path / f"state-{kind}", out, kind, seed, VERSIONS,
                     log=tmp_path / f"{kind}-{life}.log")

    def expect(p, line, log=None):
        got = p.stdout.readline().strip()
        assert got == line, f"wanted {line!r}, got {got!r}" + (f"\n{Path(log).read_text()}" if log else "")

    _, cfg = tiny_llama()

    def check(v):
        trainer = safetensors_torch.load_file(str(out / f"trainer-v{v}.safetensors"))
        hf = safetensors_torch.load_file(str(out / f"hf-v{v}.safetensors"))
        fused = safetensors_torch.load_file(str(out / f"fused-v{v}.safetensors"))
        assert sorted(hf) == sorted(trainer)
        for n, t in trainer.items():
            assert torch.equal(bits(hf[n]), bits(t)), f"version {v}: identity receiver's {n} differs"
        dense = FusedLlamaParams(cfg)
        dense.load_weights(trainer.items())
        assert sorted(fused) == sorted(dense.params)
        for n, t in dense.params.items():
            assert torch.equal(bits(fused[n]), bits(t)), f"version {v}: fused receiver's {n} differs from a dense load"

    try:
        # All three start at once: the receivers wait for the run to exist.
        trainer = spawn(TRAINER, tmp_path / "trainer-state", out, VERSIONS, stdin=subprocess.PIPE)
        fused = receiver("fused", 11, 1)
        hf = receiver("hf", 12, 1)
        expect(trainer, "committed 0")
        expect(fused, "version 0", tmp_path / "fused-1.log")
        expect(hf, "version 0", tmp_path / "hf-1.log")
        check(0)
        for v in range(1, VERSIONS + 1):
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            expect(trainer, f"committed {v}")
            expect(fused, f"version {v}", tmp_path / "fused-1.log")
            expect(hf, f"version {v}", tmp_path / f"hf-{1 if v < 3 else 2}.log")
            check(v)
            if v == 1:  # between two versions, no chance to record its stop
                os.kill(hf.pid, signal.SIGKILL)
                hf.wait(10)
                hf = receiver("hf", 13, 2)  # other weights than its journal's version: it rejoins
                expect(hf, "version 0", tmp_path / "hf-2.log")  # joined from the snapshot ...
                expect(hf, "version 1", tmp_path / "hf-2.log")  # ... and caught up
                check(1)
        for p in (trainer, fused, hf):
            assert p.wait(30) == 0
        assert "joining from the snapshot of version 0" in (tmp_path / "hf-2.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_follow_refuses_residuals_it_cannot_account_for(tmp_path):
    t = {"a": torch.zeros(4, dtype=torch.bfloat16)}
    rx = dcr.Receiver(t, dcr.identity_layout(t), residuals=["b"])
    with pytest.raises(dcr.InvalidArgumentError, match="'b' is not mapped and has no loader"):
        rx.follow(dcr.open_store(f"file://{tmp_path}/s"), tmp_path / "st", engine="e")


def test_follow_without_a_run_times_out_cleanly(tmp_path):
    t = {"a": torch.zeros(4, dtype=torch.bfloat16)}
    rx = dcr.Receiver(t)
    with pytest.raises(dcr.DeadlineExceededError, match="Receiver.follow: 0.3"):
        rx.follow(dcr.open_store(f"file://{tmp_path}/s"), tmp_path / "st", engine="e", timeout_s=0.3, poll_s=0.02)
    with pytest.raises(dcr.InvalidArgumentError, match="0 <= rank < ranks"):
        rx.follow(dcr.open_store(f"file://{tmp_path}/s"), tmp_path / "st", engine="e", rank=1, ranks=1)


def small_run(tmp_path, seed: int, vector: str) -> tuple:
    """A trainer of two random BF16 tensors ("w" and `vector`), its file
    store and ShardPublisher, with version 0 published."""
    gen = torch.Generator().manual_seed(seed)
    trainer = {"w": torch.randn(8, 16, generator=gen).to(torch.bfloat16),
               vector: torch.randn(16, generator=gen).to(torch.bfloat16)}
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [trainer], ack_timeout_s=20, chunk_elements=64)
    pub.publish_snapshot(trainer)
    return trainer, store, pub


def test_follow_hands_residuals_to_the_loader_and_calls_the_hook(tmp_path):
    """In one process (the publisher on the main thread, the receiver's
    follow on another; both release the GIL): a residual tensor the engine
    converts on load (a norm held as weight - 1) goes through the loader
    after each version, the mapped one is applied in place, and post_update
    sees every version."""
    trainer, store, pub = small_run(tmp_path, 5, "norm")
    pub.publish_snapshot(trainer)  # again, as a restarted trainer would: the same version 0

    engine = {"w": torch.zeros(8, 16, dtype=torch.bfloat16), "norm_c": torch.zeros(16, dtype=torch.bfloat16)}
    loaded, versions = [], []

    def loader(weights):
        for name, w in weights:
            assert name == "norm"
            engine["norm_c"].copy_(w.float() - 1)
            loaded.append(name)

    rx = dcr.Receiver({"w": engine["w"]}, residuals={"norm": torch.zeros(16, dtype=torch.bfloat16)}, loader=loader,
                      post_update=lambda r: versions.append((r["version"], r["residuals_loaded"])))
    with following(rx, store, tmp_path / "rx", engine="e", until=2, timeout_s=30, poll_s=0.02) as result:
        for v in (1, 2):
            trainer["w"][v].add_(1)
            trainer["norm"][3 * v:3 * v + 2].mul_(2)
            assert pub.publish(v)["acked"] == ["e-r0"]
    assert result == [2], result
    assert versions == [(0, ["norm"]), (1, ["norm"]), (2, ["norm"])]
    assert torch.equal(engine["w"].view(torch.int16), trainer["w"].view(torch.int16))
    assert torch.equal(engine["norm_c"], (trainer["norm"].float() - 1).to(torch.bfloat16))


def test_a_receiver_adopts_the_committed_version_its_tensors_hold(tmp_path):
    """Receiver.adopt: tensors loaded elsewhere (a serving engine reading the
    checkpoint from disk) that hold committed version 1 follow on from it
    through the delta of version 2; the store holds no snapshot any more, so
    a join could not have worked. A digest that is not the version's, or a
    version never committed, is refused and records nothing."""
    trainer, store, pub = small_run(tmp_path, 3, "b")
    trainer["w"][1].add_(1)
    pub.publish(1)
    held = {n: t.clone() for n, t in trainer.items()}  # version 1, loaded "from disk"
    trainer["b"][2:5].mul_(2)
    pub.publish(2)
    for key, _, _ in store.list("snapshots/"):
        store.delete(key)

    halves = [{"w": held["w"]}, {"b": held["b"]}]  # an engine of two ranks
    ranks = [dcr.Receiver(h) for h in halves]
    engine_digest = dcr.add_digests(r.digest() for r in ranks)
    assert engine_digest == dcr.add_digests([ranks[1].digest(), ranks[0].digest(), "0" * 32])
    with pytest.raises(dcr.FailedPreconditionError, match="do not hold version 2"):
        ranks[0].adopt(store, tmp_path / "r0", 2, engine_digest, engine="e", ranks=2)
    with pytest.raises(dcr.NotFoundError):
        ranks[0].adopt(store, tmp_path / "r0", 5, engine_digest, engine="e", ranks=2)
    with pytest.raises(dcr.FailedPreconditionError, match="rank 0 of 1 holds digest"):
        ranks[0].adopt(store, tmp_path / "r0", 1, engine_digest, engine="e")  # one rank: its own digest must be it
    assert not (tmp_path / "r0").exists()
    with pytest.raises(dcr.InvalidArgumentError):
        dcr.add_digests(["not a digest"])
    for r, rx in enumerate(ranks):
        rx.adopt(store, tmp_path / f"r{r}", 1, engine_digest, engine="e", rank=r, ranks=2)
        assert rx.follow(store, tmp_path / f"r{r}", engine="e", rank=r, ranks=2, until=2, timeout_s=60,
                         poll_s=0.02) == 2
    for n, t in trainer.items():
        assert torch.equal(held[n].view(torch.int16), t.view(torch.int16)), n
