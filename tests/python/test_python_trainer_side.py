"""The Python package's trainer-side and staging paths (docs/python.md):
ShardPublisher conversions (canonical tensors computed from live
parameters: a zero-centred norm, a cast of fp32 master weights), follow
handing only the residual tensors a version changed to the loader, host
staging of tensors (forced on CPU: no GPU here), and Ctrl-C while a publish
waits for acks (a real trainer process sent SIGINT). Comparisons are of
bytes against dense copies, never of dcr's own digests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch.nn.utils import parametrize  # noqa: E402

import dcr  # noqa: E402
from conftest import read_checkpoint  # noqa: E402
from test_python_refit_models import bits, tiny_llama  # noqa: E402

HERE = str(Path(__file__).resolve().parent)


def follow_in_thread(rx, store, state, **kw):
    """Receiver.follow on a thread (it releases the GIL); returns (thread, result list)."""
    result: list = []

    def run():
        try:
            result.append(rx.follow(store, state, **kw))
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            result.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120  # a guard only: the publishes that follow must wait for this receiver
    while not store.list("receivers/"):
        assert t.is_alive() and time.monotonic() < deadline, f"the receiver did not register: {result}"
        time.sleep(0.01)
    return t, result


class PlusOne(torch.nn.Module):
    """A zero-centred norm: the parameter holds weight - 1."""

    def forward(self, x):
        return x + 1

    def right_inverse(self, w):
        return w - 1


class CastToBf16(torch.nn.Module):
    """fp32 master weights, used (and published) as bf16."""

    def forward(self, x):
        return x.to(torch.bfloat16)


def converting_trainer():
    """A tiny Llama whose final norm is held as weight - 1 and whose lm_head
    is fp32 master weights cast to bf16; the senders' tensors (canonical
    names, the parameters that are pure copies) and the conversions."""
    model, cfg = tiny_llama()
    parametrize.register_parametrization(model.model.norm, "weight", PlusOne())
    model.lm_head.float()  # the master weights; the forward uses (and dcr publishes) their bf16 cast
    parametrize.register_parametrization(model.lm_head, "weight", CastToBf16(), unsafe=True)
    assert model.model.norm.parametrizations.weight.original.dtype == torch.bfloat16
    assert model.lm_head.parametrizations.weight.original.dtype == torch.float32
    live = {n: p.data for n, p in model.named_parameters() if "parametrizations" not in n}
    conversions = {"model.norm.weight": lambda: model.model.norm.weight,
                   "lm_head.weight": lambda: model.lm_head.weight}
    return model, cfg, live, conversions


def canonical_now(live, conversions):
    with torch.no_grad():
        out = {n: t.clone() for n, t in live.items()}
        out.update({n: f().detach().clone() for n, f in conversions.items()})
    return out


def test_converted_tensors_published_from_live_parameters_are_bit_exact(tmp_path):
    model, cfg, live, conversions = converting_trainer()
    store = dcr.open_store(f"file://{tmp_path}/store")
    names = sorted(live)
    senders = [{n: live[n] for n in names[0::2]}, {n: live[n] for n in names[1::2]}]
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", senders, conversions=conversions, ack_timeout_s=30,
                             chunk_elements=512)
    want = {0: canonical_now(live, conversions)}
    pub.publish_snapshot(live)  # the converted tensors come from the conversions

    gen = torch.Generator().manual_seed(3)
    rx_tensors = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in want[0].items()}
    got = {}
    rx = dcr.Receiver(rx_tensors, post_update=lambda r: got.__setitem__(
        r["version"], {n: t.clone() for n, t in rx_tensors.items()}))
    versions = 3
    thread, result = follow_in_thread(rx, store, tmp_path / "rx", engine="hf", until=versions, timeout_s=60,
                                      poll_s=0.02)
    reports = []
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for v in range(1, versions + 1):
            ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            reports.append(pub.publish(v))
            want[v] = canonical_now(live, conversions)
    finally:
        thread.join(60)
    assert result == [versions], result
    assert sorted(got) == list(range(versions + 1))
    for v in range(versions + 1):
        assert sorted(got[v]) == sorted(want[v])
        for n, t in want[v].items():
            assert torch.equal(bits(got[v][n]), bits(t)), f"version {v}: {n} differs from the canonical tensor"
    norm_bytes, head_bytes = cfg.hidden_size * 2, cfg.vocab_size * cfg.hidden_size * 2
    for r in reports:
        assert r["acked"] == ["hf-r0"]
        assert r["converted_bytes"] == norm_bytes + head_bytes
        assert r["projected_bytes"] == r["total_bytes"] - r["converted_bytes"] > 0
        assert 0 < r["converted_changed_bytes"] <= r["converted_bytes"]  # AdamW moves every weight a little
    # The canonical norm is not the parameter: the receiver got weight, not weight - 1.
    original = model.model.norm.parametrizations.weight.original
    assert not torch.equal(bits(got[versions]["model.norm.weight"]), bits(original.data))


def test_conversions_are_refused_with_a_reason(tmp_path):
    t = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8).to(torch.bfloat16)}
    norm = torch.ones(8, dtype=torch.bfloat16)
    store = dcr.open_store(f"file://{tmp_path}/store")
    with pytest.raises(dcr.InvalidArgumentError, match="conversion 'w' names a tensor a sender's map already maps"):
        dcr.ShardPublisher(store, tmp_path / "t0", [t], conversions={"w": lambda: t["w"]})
    cast = {"dtype": torch.bfloat16}
    pub = dcr.ShardPublisher(store, tmp_path / "t1", [t], conversions={"norm": lambda: (norm + 0).to(**cast)},
                             ack_timeout_s=5, chunk_elements=64)
    pub.publish_snapshot(t)
    cast["dtype"] = torch.float32
    with pytest.raises(dcr.InvalidArgumentError, match=r"conversion 'norm': returned F32 \[8\], the run's tensor is "
                                                       r"BF16 \[8\]"):
        pub.publish(1)
    # A conversion of a tensor the run does not have: the C++ check, naming the conversions' sender.
    extra = dcr.ShardPublisher(store, tmp_path / "t2", [t],
                               conversions={"norm": lambda: norm, "bogus": lambda: torch.zeros(2)}, ack_timeout_s=5,
                               chunk_elements=64)
    with pytest.raises(dcr.InvalidArgumentError, match=r"'bogus' is not in the checkpoint.*sender 1 holds the "
                                                       r"conversions"):
        extra.publish(1)
    # Without the conversion, the run's tensor is unmapped.
    bare = dcr.ShardPublisher(store, tmp_path / "t3", [t], ack_timeout_s=5, chunk_elements=64)
    with pytest.raises(dcr.InvalidArgumentError, match="no sender maps tensor 'norm'"):
        bare.publish(1)
    cast["dtype"] = torch.bfloat16
    assert pub.publish(1)["converted_bytes"] == 16


def test_relay_arguments_are_refused_with_a_reason(tmp_path):
    t = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    store = dcr.open_store(f"file://{tmp_path}/store")
    with pytest.raises(dcr.InvalidArgumentError, match="relay_key, relay_pub and relay_insecure need relay addresses"):
        dcr.ShardPublisher(store, None, [t], relay_key=str(tmp_path / "k.key"))
    # Without keys, or with keys and insecure: the reason names this API's arguments.
    with pytest.raises(dcr.InvalidArgumentError, match=r"key pair \(relay_key;.*ask for relay_insecure"):
        dcr.ShardPublisher(store, None, [t], relay=["tcp://127.0.0.1:9"])
    with pytest.raises(dcr.InvalidArgumentError, match=r"a key pair \(relay_key\) and relay_insecure together"):
        dcr.ShardPublisher(store, None, [t], relay=["tcp://127.0.0.1:9"], relay_key=str(tmp_path / "k.key"),
                           relay_insecure=True)
    with pytest.raises(dcr.DcrError, match="k.key"):  # a key file that is not there
        dcr.ShardPublisher(store, None, [t], relay=["tcp://127.0.0.1:9"], relay_key=str(tmp_path / "k.key"),
                           relay_pub=str(tmp_path / "k.pub"))


def test_follow_hands_only_the_residuals_a_version_changed_to_the_loader(tmp_path):
    gen = torch.Generator().manual_seed(9)
    trainer = {"w": torch.randn(8, 16, generator=gen).to(torch.bfloat16),
               "norm_a": torch.randn(16, generator=gen).to(torch.bfloat16),
               "norm_b": torch.randn(16, generator=gen).to(torch.bfloat16)}
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [trainer], ack_timeout_s=20, chunk_elements=64)
    pub.publish_snapshot(trainer)
    engine = {"w": torch.zeros(8, 16, dtype=torch.bfloat16), "a_c": torch.zeros(16, dtype=torch.bfloat16),
              "b_c": torch.zeros(16, dtype=torch.bfloat16)}
    calls, versions, want = [], [], {}

    def loader(weights):
        names = []
        for name, w in weights:
            engine[{"norm_a": "a_c", "norm_b": "b_c"}[name]].copy_(w.float() - 1)
            names.append(name)
        calls.append(names)

    def post_update(r):
        versions.append((r["version"], r["residuals_loaded"]))
        for n, t in want.get(r["version"], {}).items():
            assert torch.equal(bits(engine[n]), bits(t)), f"version {r['version']}: {n}"

    zeros = {n: torch.zeros(16, dtype=torch.bfloat16) for n in ("norm_a", "norm_b")}
    rx = dcr.Receiver({"w": engine["w"]}, residuals=zeros, loader=loader, post_update=post_update)
    thread, result = follow_in_thread(rx, store, tmp_path / "rx", engine="e", until=3, timeout_s=30, poll_s=0.02)

    def expect():
        return {"w": trainer["w"].clone(), "a_c": (trainer["norm_a"].float() - 1).to(torch.bfloat16),
                "b_c": (trainer["norm_b"].float() - 1).to(torch.bfloat16)}

    try:
        want[0] = expect()
        for v, change in ((1, "norm_a"), (2, "norm_b"), (3, "w")):
            trainer[change][1:3].mul_(2)
            want[v] = expect()
            assert pub.publish(v)["acked"] == ["e-r0"]
    finally:
        thread.join(60)
    assert result == [3], result
    assert versions == [(0, ["norm_a", "norm_b"]), (1, ["norm_a"]), (2, ["norm_b"]), (3, [])]
    assert calls == [["norm_a", "norm_b"], ["norm_a"], ["norm_b"]]

    # A restarted process with the same state directory reopens its journal:
    # it cannot know what its loader saw, so every residual is handed over once.
    calls.clear()
    versions.clear()
    engine2 = {"w": engine["w"].clone()}
    shadows = {"norm_a": trainer["norm_a"].clone(), "norm_b": trainer["norm_b"].clone()}
    rx2 = dcr.Receiver(engine2, residuals=shadows, loader=loader, post_update=post_update)
    assert rx2.follow(store, tmp_path / "rx", engine="e", until=3, timeout_s=30, poll_s=0.02) == 3
    assert versions == [(3, ["norm_a", "norm_b"])]


def storage_span(t):
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def assert_disjoint(views, live):
    """No byte view dcr got lies in a live tensor's storage."""
    spans = [storage_span(t) for t in live.values()]
    for v in views:
        p = v.data_ptr()
        assert not any(lo <= p < hi for lo, hi in spans), "dcr was handed a live tensor's memory"


def test_staged_sender_reads_mirrors_and_staged_receiver_writes_the_live_tensors_in_place():
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    live = {"a": torch.randn(32, 8, generator=gen).to(torch.bfloat16), "b": base.t(),  # a strided view
            "c": torch.randn(64, generator=gen)}
    with pytest.raises(dcr.InvalidArgumentError, match="not contiguous"):
        dcr.Sender(live)  # unstaged, the strided view cannot be read in place
    tx = dcr.Sender(live, stage=True)
    assert_disjoint(tx._views, live)
    rx_base = base.clone()
    rx_live = {n: t.clone() for n, t in live.items()}  # the receiver holds the baseline
    rx_live["b"] = rx_base.t()
    storage = {n: t.untyped_storage().data_ptr() for n, t in rx_live.items()}
    rx = dcr.Receiver(rx_live, stage=True)
    assert rx._buffers == []  # no host memory handed to dcr: the tensors are reached through torch
    live["a"][0].add_(1)
    base[2:4].mul_(2)  # through the strided view's storage
    overwrite = tx.make_delta(mode="overwrite", chunk_elements=64)
    assert rx.apply(overwrite)["frames_applied"] > 0
    for n, t in live.items():
        assert torch.equal(bits(rx_live[n].contiguous()), bits(t.contiguous())), n
    assert torch.equal(bits(rx_base), bits(base))  # written through the receiver's strided view
    assert {n: t.untyped_storage().data_ptr() for n, t in rx_live.items()} == storage
    tx.commit(overwrite)

    live["a"][3:5].add_(1)
    delta = tx.make_delta(chunk_elements=64)  # xor: the receiver's tensors hold the base bits
    assert {f["tensor"] for f in json.loads(delta.manifest_json)["frames"]} == {0}
    rx.apply(delta)
    for n, t in live.items():
        assert torch.equal(bits(rx_live[n].contiguous()), bits(t.contiguous())), n
    assert rx.digest() == delta.target_digest
    tx.commit(delta)

    # Bits changed behind dcr's back are not in the digests it tracks (they
    # follow what it writes); once told, it digests the tensors again and the
    # next apply refuses to call the version whole.
    rx_live["c"].fill_(7)
    live["a"][6].add_(1)
    later = tx.make_delta(chunk_elements=64)
    rx.forget_digests()
    with pytest.raises(dcr.DataLossError, match="add up to digest"):
        rx.apply(later)
    with pytest.raises(dcr.InvalidArgumentError, match="not contiguous"):
        dcr.Receiver(rx_live, stage=False)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


# On CPU the tensors are staged on request (stage=True); on a GPU (where one
# exists) they live on the device and are staged because they are there.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_staged_publisher_and_follower_are_bit_exact(tmp_path, device):
    gen = torch.Generator().manual_seed(6)
    live = {"w": torch.randn(24, 16, generator=gen).to(torch.bfloat16).to(device),
            "v": torch.randn(40, generator=gen).to(device)}
    stage = True if device == "cpu" else None
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [live], stage=stage, ack_timeout_s=20, chunk_elements=64)
    if device == "cpu":
        assert_disjoint(pub._views[0], live)
    pub.publish_snapshot(live)
    rx_live = {n: torch.zeros(t.shape, dtype=t.dtype, device=device) for n, t in live.items()}
    seen = {}
    rx = dcr.Receiver(rx_live, stage=stage,
                      post_update=lambda r: seen.__setitem__(r["version"], {n: t.clone() for n, t in rx_live.items()}))
    if device == "cpu":
        assert_disjoint(rx._buffers, rx_live)
    thread, result = follow_in_thread(rx, store, tmp_path / "rx", engine="e", until=2, timeout_s=30, poll_s=0.02)
    want = {0: {n: t.clone() for n, t in live.items()}}
    try:
        for v in (1, 2):
            live["w"][v].add_(1)
            live["v"][:v].mul_(3)
            want[v] = {n: t.clone() for n, t in live.items()}
            assert pub.publish(v)["acked"] == ["e-r0"]
    finally:
        thread.join(60)
    assert result == [2], result
    for v in (0, 1, 2):
        for n, t in want[v].items():
            assert torch.equal(bits(seen[v][n]), bits(t)), f"version {v}: {n}"


def test_staging_runs_on_the_publishers_copy_thread_once_per_buffer(tmp_path):
    """A copy engine that delays stands in for device -> host copies: each publish
    copies every buffer once, on the publisher's copy thread, not the caller's; a
    copy that raises fails that publish and commits nothing."""
    gen = torch.Generator().manual_seed(8)
    live = {f"t{i}": torch.randn(96, generator=gen).to(torch.bfloat16) for i in range(6)}
    caller, copies, broken = threading.get_ident(), [], []

    def slow_copy(dst, src):
        time.sleep(0.005)
        if broken:
            raise RuntimeError("the device was lost")
        copies.append(threading.get_ident())
        dst.copy_(src)

    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [live], stage=True, copy_engine=slow_copy,
                             ack_timeout_s=20, chunk_elements=64)
    pub.publish_snapshot(live)
    # The snapshot's tensors are the senders' baseline at once (adopted, not downloaded at version 1).
    with open(os.path.join(pub.state_dir, "shards.json")) as f:
        assert json.load(f)["version"] == 0
    for v in (1, 2):
        copies.clear()
        live[f"t{v}"].add_(1)
        report = pub.publish(v)
        assert len(copies) == len(live) and caller not in copies, copies
        assert report["staging_seconds"] > 0, report
        held = sum(t.numel() * t.element_size() for t in live.values())
        assert report["memory"]["staging_bytes"] == held and report["memory"]["baseline_bytes"] == held, report
    live["t3"].mul_(2)
    broken.append(True)
    with pytest.raises(dcr.AbortedError, match="the device was lost"):
        pub.publish(3)
    assert dcr.open_store(f"file://{tmp_path}/store").list("commits/")[-1][0].endswith("v0000000002.json")
    broken.clear()
    assert pub.publish(3)["version"] == 3
    dcr.Follower(store, tmp_path / "engine").run(until=3, timeout_s=30)
    got = read_checkpoint(tmp_path / "engine")
    for n, t in live.items():
        assert got[n].data == bits(t).numpy().tobytes(), n
    live["t0"].add_(1)
    with pytest.raises(dcr.FailedPreconditionError, match="not version 3"):
        pub.adopt(3)


TRAINER = """
import sys, time, torch, dcr
url, state, out = sys.argv[1:4]
t = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
pub = dcr.ShardPublisher(dcr.open_store(url), state, [t], ack_timeout_s=600, heartbeat_timeout_s=600,
                         chunk_elements=512)
if sys.argv[4] == "snapshot":
    pub.publish_snapshot(t)
    print("snapshot", flush=True)
    sys.exit(0)
t["w"][5].add_(1)
try:
    report = pub.publish(1)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
    sys.exit(0)
print("committed", report["acked"], flush=True)
"""

RECEIVER = """
import sys, torch, dcr
url, state, out = sys.argv[1:4]
t = {"w": torch.zeros(64, 64)}
def saved(r):
    torch.save(t["w"].clone(), f"{out}/rx-v{r['version']}.pt")
    print("version", r["version"], flush=True)
dcr.Receiver(t, post_update=saved).follow(dcr.open_store(url), state, engine="rx", poll_s=0.02)
"""


def test_ctrl_c_interrupts_a_publish_waiting_for_acks(tmp_path):
    """A trainer process waits for the ack of a receiver that is alive (its
    heartbeat fresh) but stopped (SIGSTOP); SIGINT makes its publish raise
    KeyboardInterrupt promptly, with the attempt fenced and nothing
    committed. The receiver resumed, a new trainer process publishes the
    version again and it commits, the receiver's bytes equal the trainer's.
    Ordered by handshakes: the receiver is stopped once the store shows it
    following, and the trainer's heartbeat and ack timeouts (600 s) outlast
    the test's set-up on a busy machine by far."""
    url = f"file://{tmp_path}/store"
    procs = []

    def spawn(script, *args):
        p = subprocess.Popen([sys.executable, "-c", script, url, *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append(p)
        return p

    def line(p):
        got = p.stdout.readline()
        assert got, p.stderr.read() if p.poll() is not None else "no output"
        return got.split()

    store = dcr.open_store(url)
    try:
        snap = spawn(TRAINER, tmp_path / "trainer", tmp_path, "snapshot")
        assert line(snap) == ["snapshot"] and snap.wait(120) == 0
        rx = spawn(RECEIVER, tmp_path / "rx", tmp_path)
        assert line(rx) == ["version", "0"]

        def following():
            for k, _, _ in store.list("receivers/"):
                record = json.loads(store.get(k))
                if record.get("state") == "following" and record.get("version") == 0:
                    return True
            return False

        deadline = time.monotonic() + 120  # a guard only
        while not following():
            assert time.monotonic() < deadline, "the receiver never showed as following in the store"
            time.sleep(0.01)
        os.kill(rx.pid, signal.SIGSTOP)
        trainer = spawn(TRAINER, tmp_path / "trainer", tmp_path, "publish")
        deadline = time.monotonic() + 120  # a guard only
        # Until its attempt's manifest is written: it waits for acks (or is
        # about to; a SIGINT before its first poll is seen at that poll).
        while not any(k.endswith("/manifest.bin") for k, _, _ in store.list("attempts/")):
            if time.monotonic() > deadline or trainer.poll() is not None:
                pytest.fail("the trainer wrote no attempt: " + (trainer.stderr.read() if trainer.poll() is not None
                                                                 else "within 120 s"))
            time.sleep(0.01)
        sent = time.monotonic()
        trainer.send_signal(signal.SIGINT)
        got = line(trainer)
        assert got[0] == "interrupted", got
        # Promptly: long before the ack deadline (600 s) would have ended the wait.
        assert float(got[1]) - sent < 60.0, "KeyboardInterrupt took too long"
        assert trainer.wait(120) == 0
        keys = [k for k, _, _ in store.list("")]
        assert not any(k.startswith("commits/v0000000001") for k in keys), keys
        attempts = {k.split("/")[2] for k in keys if k.startswith("attempts/v0000000001/")}
        assert len(attempts) == 1, keys  # not retried
        assert any(k.endswith("/fence") for k in keys if k.startswith("attempts/v0000000001/")), keys

        os.kill(rx.pid, signal.SIGCONT)
        again = spawn(TRAINER, tmp_path / "trainer", tmp_path, "publish")
        assert line(again)[0] == "committed"
        assert again.wait(120) == 0
        assert line(rx) == ["version", "1"]
        want = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
        want[5].add_(1)
        assert torch.equal(bits(torch.load(tmp_path / "rx-v1.pt")), bits(want))
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
