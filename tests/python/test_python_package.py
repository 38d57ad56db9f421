"""The Python package (python/dcr): errors, zero-copy views, file deltas,
stores, the refit protocol, and in-memory layout deltas over live torch
tensors, including a transformers model refit into a fused, vLLM-style copy.

Bits are compared as integer views everywhere (+0/-0 and NaN payloads
count); files are read back with conftest's independent safetensors reader.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading

import numpy as np
import pytest
import torch

import dcr
from dcr import _dcr

from conftest import read_checkpoint

# (old, new) bit patterns: +0 -> -0, NaN payload changes, subnormals, +inf -> -inf, an unchanged NaN.
BF16_SPECIALS = [(0x0000, 0x8000), (0x8000, 0x0000), (0x7FC1, 0x7FC3), (0xFFC1, 0x7FC1), (0x0001, 0x0002),
                 (0x807F, 0x0001), (0x7F80, 0xFF80), (0x7FC1, 0x7FC1)]
F32_SPECIALS = [(0x00000000, 0x80000000), (0x7FC00001, 0x7FC00002), (0x00000001, 0x807FFFFF),
                (0x7F800000, 0x7F800001), (0xFF800000, 0x7F800000), (0x7FC00000, 0x7FC00000)]
FP8_SPECIALS = [(0x00, 0x80), (0x7F, 0xFF), (0x01, 0x02), (0x7E, 0x7F), (0x80, 0x00), (0xFF, 0xFF)]

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float8_e4m3fn: torch.uint8, torch.int32: torch.int32, torch.uint8: torch.uint8}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(INT_VIEW[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def poke(t: torch.Tensor, pairs, which: int) -> None:
    """Writes the old (which=0) or new (1) patterns into the first elements."""
    flat = bits(t).reshape(-1)
    for k, p in enumerate(pairs):
        v = p[which]
        if flat.dtype == torch.int16 and v >= 0x8000:
            v -= 0x10000
        if flat.dtype == torch.int32 and v >= 0x80000000:
            v -= 1 << 32
        flat[k] = v


def random_tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(40, 24, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(24, 36, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(24, generator=g),
        "model.layers.0.mlp.experts.w.fp8": (torch.randn(16, 32, generator=g) * 10).to(torch.float8_e4m3fn),
        "model.counts": torch.randint(-1000, 1000, (7, 3), generator=g, dtype=torch.int32),
        "model.half": torch.randn(5, 9, generator=g).to(torch.float16),
    }


def step(tensors: dict, seed: int, rate: float = 0.05) -> None:
    """Changes about `rate` of each tensor's elements in place (bit flips of
    the low mantissa / low bits, so every dtype changes)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        flat = bits(t).reshape(-1)
        mask = torch.rand(flat.numel(), generator=g) < rate
        flat[mask] ^= 1


def with_specials(tensors: dict, which: int) -> dict:
    poke(tensors["model.embed_tokens.weight"], BF16_SPECIALS, which)
    poke(tensors["model.norm.weight"], F32_SPECIALS, which)
    poke(tensors["model.layers.0.mlp.experts.w.fp8"], FP8_SPECIALS, which)
    return tensors


def write_checkpoint(path, tensors: dict) -> dcr.Checkpoint:
    """Creates a checkpoint through dcr and fills it through its zero-copy torch views."""
    ck = dcr.Checkpoint.create(path, {n: (dcr.dtype_name(t), list(t.shape)) for n, t in tensors.items()})
    for n, t in tensors.items():
        ck.tensor(n).copy_(t)
    ck.sync()
    return ck


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("code,cls", [
    ("INVALID_ARGUMENT", dcr.InvalidArgumentError), ("NOT_FOUND", dcr.NotFoundError),
    ("ALREADY_EXISTS", dcr.AlreadyExistsError), ("PERMISSION_DENIED", dcr.PermissionDeniedError),
    ("OUT_OF_RANGE", dcr.OutOfRangeError), ("FAILED_PRECONDITION", dcr.WrongBaseError),
    ("ABORTED", dcr.FencedAttemptError), ("UNAVAILABLE", dcr.StoreUnavailableError),
    ("DEADLINE_EXCEEDED", dcr.DeadlineExceededError), ("DATA_LOSS", dcr.CorruptFrameError),
    ("UNIMPLEMENTED", dcr.UnimplementedError), ("INTERNAL", dcr.InternalError),
])
def test_every_status_code_raises_its_class(code, cls):
    with pytest.raises(cls) as e:
        _dcr._raise_status(code, "the message")
    assert isinstance(e.value, dcr.DcrError)
    assert e.value.code == code and e.value.message == "the message"
    assert str(e.value) == f"{code}: the message"
    # Exactly one class per code: no other code's class matches.
    others = {dcr.InvalidArgumentError, dcr.NotFoundError, dcr.FailedPreconditionError, dcr.AbortedError,
              dcr.UnavailableError, dcr.DataLossError} - {cls}
    assert not any(isinstance(e.value, o) for o in others)


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_views_are_the_mapped_bytes(tmp_path):
    tensors = with_specials(random_tensors(1), 1)
    ck = write_checkpoint(tmp_path / "c.safetensors", tensors)
    # What dcr wrote through the views is in the file, as an independent reader sees it.
    raw = read_checkpoint(tmp_path / "c.safetensors")
    assert sorted(raw) == sorted(tensors)
    for n, t in tensors.items():
        assert raw[n].dtype == dcr.dtype_name(t) and raw[n].shape == list(t.shape)
        assert raw[n].data == t.contiguous().view(torch.uint8).numpy().tobytes(), n
    # Views share memory: numpy, torch and a second view have the same address.
    for n in tensors:
        a, t1, t2 = ck.array(n), ck.tensor(n), ck.tensor(n)
        assert t1.data_ptr() == t2.data_ptr() == a.ctypes.data
        assert t1.dtype == tensors[n].dtype
    assert ck.array("model.embed_tokens.weight").dtype == np.uint16  # BF16 through numpy
    assert ck.tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert ck.tensor("model.layers.0.mlp.experts.w.fp8").dtype == torch.float8_e4m3fn
    # Read-only opens give read-only views.
    ro = dcr.Checkpoint.open(tmp_path / "c.safetensors")
    assert not ro.array("model.norm.weight").flags.writeable
    assert same_bits(ro.tensor("model.norm.weight"), tensors["model.norm.weight"])
    with pytest.raises(dcr.NotFoundError, match="no tensor 'nope'"):
        ro.array("nope")
    with pytest.raises(dcr.NotFoundError):
        dcr.Checkpoint.open(tmp_path / "missing.safetensors")


def test_views_keep_the_checkpoint_alive(tmp_path):
    tensors = random_tensors(2)
    write_checkpoint(tmp_path / "c.safetensors", tensors)
    t = dcr.Checkpoint.open(tmp_path / "c.safetensors").tensor("model.half")
    import gc
    gc.collect()
    assert same_bits(t, tensors["model.half"])


# ---------------------------------------------------------------- file deltas

@pytest.mark.parametrize("mode", ["xor", "overwrite"])
def test_file_delta_round_trip_is_bit_exact_and_in_place(tmp_path, mode):
    base_t = with_specials(random_tensors(3), 0)
    next_t = with_specials({n: t.clone() for n, t in base_t.items()}, 1)
    step(next_t, seed=4)
    write_checkpoint(tmp_path / "v0", base_t)
    write_checkpoint(tmp_path / "v1", next_t)
    manifest = dcr.make_delta(tmp_path / "v0", tmp_path / "v1", tmp_path / "d", mode=mode, chunk_elements=64)
    assert manifest["frames"], "the versions differ, so there are frames"
    assert dcr.inspect_delta(tmp_path / "d")["target_digest"] == manifest["target_digest"]

    shutil.copytree(tmp_path / "v0", tmp_path / "rx")
    rx = dcr.Checkpoint.open(tmp_path / "rx", writable=True)
    views = {n: rx.tensor(n) for n in rx.names()}  # taken before the apply
    ptrs = {n: v.data_ptr() for n, v in views.items()}
    report = dcr.apply_delta(rx, tmp_path / "d")
    assert report["frames_applied"] == len(manifest["frames"])
    # The C++ apply wrote into the memory the views already point at.
    for n, v in views.items():
        assert v.data_ptr() == ptrs[n]
        assert same_bits(v, next_t[n]), n
    assert dcr.verify_delta(rx, tmp_path / "d") == (True, [])
    assert dcr.verify_delta(tmp_path / "v0", tmp_path / "d").matches is False
    assert dcr.verify_delta(tmp_path / "v0", tmp_path / "d", against_base=True).matches
    # On disk too, per an independent reader.
    raw = read_checkpoint(tmp_path / "rx")
    for n, t in next_t.items():
        assert raw[n].data == t.contiguous().view(torch.uint8).numpy().tobytes(), n
    again = dcr.apply_delta(rx, tmp_path / "d")
    assert again["frames_applied"] == 0 and again["frames_already_applied"] == len(manifest["frames"])


def test_wrong_base_and_corrupt_frames_raise_their_classes(tmp_path):
    base_t = random_tensors(5)
    next_t = {n: t.clone() for n, t in base_t.items()}
    step(next_t, seed=6, rate=0.2)
    other_t = {n: t.clone() for n, t in base_t.items()}
    step(other_t, seed=7, rate=0.2)
    for name, t in (("v0", base_t), ("v1", next_t), ("other", other_t)):
        write_checkpoint(tmp_path / name, t)
    dcr.make_delta(tmp_path / "v0", tmp_path / "v1", tmp_path / "d", chunk_elements=64)

    before = read_checkpoint(tmp_path / "other")
    with pytest.raises(dcr.WrongBaseError) as e:
        dcr.apply_delta(tmp_path / "other", tmp_path / "d")
    assert e.value.code == "FAILED_PRECONDITION"
    assert {n: r.data for n, r in read_checkpoint(tmp_path / "other").items()} == {n: r.data for n, r in before.items()}

    # One flipped payload byte: the checksum catches it before anything is written.
    shutil.copytree(tmp_path / "d", tmp_path / "bad")
    frames = bytearray((tmp_path / "bad" / "frames.bin").read_bytes())
    frames[-3] ^= 0x40
    (tmp_path / "bad" / "frames.bin").write_bytes(bytes(frames))
    with pytest.raises(dcr.CorruptFrameError):
        dcr.inspect_delta(tmp_path / "bad")
    shutil.copytree(tmp_path / "v0", tmp_path / "rx")
    with pytest.raises(dcr.CorruptFrameError) as e:
        dcr.apply_delta(tmp_path / "rx", tmp_path / "bad")
    assert e.value.code == "DATA_LOSS"

    with pytest.raises(dcr.InvalidArgumentError, match="mode"):
        dcr.make_delta(tmp_path / "v0", tmp_path / "v1", tmp_path / "d2", mode="sideways")
    with pytest.raises(dcr.InvalidArgumentError, match="read-only"):
        dcr._dcr.apply_delta(dcr.Checkpoint.open(tmp_path / "rx")._c, str(tmp_path / "d"))


# ---------------------------------------------------------------- stores and the protocol

def test_store_put_get_list_and_errors(tmp_path):
    for url in ("mem://pytest-store", f"file://{tmp_path}/store"):
        s = dcr.open_store(url)
        s.put("a/x.bin", b"\x00\x01\xff")
        s.put("a/y.bin", b"yy")
        assert s.get("a/x.bin") == b"\x00\x01\xff"
        assert [k for k, _, _ in s.list("a/")] == ["a/x.bin", "a/y.bin"]
        assert s.head("a/y.bin")[1] == 2
        with pytest.raises(dcr.NotFoundError):
            s.get("a/missing")
        s.put("once", b"1", create_if_absent=True)
        with pytest.raises(dcr.AlreadyExistsError):
            s.put("once", b"2", create_if_absent=True)
        assert s.get("once") == b"1"
        with pytest.raises(dcr.InvalidArgumentError):
            s.put("../escape", b"")
        s.delete("a/x.bin")
        assert [k for k, _, _ in s.list("a/")] == ["a/y.bin"]
    with pytest.raises(dcr.InvalidArgumentError):
        dcr.open_store("gopher://nowhere")


def published_run(tmp_path, versions: int, tensors: int = 8, seed: int = 10, ack_timeout_s: float = 30):
    """A file store with version 0 published, checkpoints v0..v{versions} written; (store, publisher, tensors)."""
    vs = [random_tensors(tensors)]
    for v in range(1, versions + 1):
        nxt = {n: t.clone() for n, t in vs[-1].items()}
        step(nxt, seed=seed + v)
        vs.append(nxt)
    for v, t in enumerate(vs):
        write_checkpoint(tmp_path / f"v{v}", t)
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.Publisher(store, tmp_path / "state", ack_timeout_s=ack_timeout_s, chunk_elements=64)
    assert pub.publish(0, tmp_path / "v0")["version"] == 0
    return store, pub, vs


def test_publish_and_follow_through_a_file_store(tmp_path):
    store, pub, versions = published_run(tmp_path, 3)

    fol = dcr.Follower(store, tmp_path / "engine", id="rx-1", poll_s=0.02)
    result = {}

    def follow():
        try:
            result["version"] = fol.run(until=3, timeout_s=60)
        except dcr.DcrError as e:  # pragma: no cover - reported below
            result["error"] = e

    th = threading.Thread(target=follow)
    th.start()  # the GIL is released while it follows
    for v in range(1, 4):
        rep = pub.publish(v, dcr.Checkpoint.open(tmp_path / f"v{v}"))
        assert rep["version"] == v
    th.join(90)
    assert not th.is_alive() and result == {"version": 3}
    raw = read_checkpoint(tmp_path / "engine")
    for n, t in versions[3].items():
        assert raw[n].data == t.contiguous().view(torch.uint8).numpy().tobytes(), n
    with pytest.raises(dcr.WrongBaseError):
        pub.publish(5, tmp_path / "v3")  # v4 is not committed
    with pytest.raises(dcr.DeadlineExceededError):
        dcr.Follower(store, tmp_path / "engine", id="rx-1").run(until=9, timeout_s=0.3)
    for bad in (0, -1, 3601, float("nan")):
        with pytest.raises(dcr.InvalidArgumentError, match="relay_poll_s"):
            dcr.Follower(store, tmp_path / "engine", id="rx-1", relay_poll_s=bad)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_publishers_state_is_in_memory_by_default_and_held_by_one_publisher(tmp_path):
    vs = [random_tensors(8)]
    vs.append({n: t.clone() for n, t in vs[0].items()})
    step(vs[1], seed=3)
    for v, t in enumerate(vs):
        write_checkpoint(tmp_path / f"v{v}", t)
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.Publisher(store, chunk_elements=64)
    try:
        assert pub.state_dir == dcr.default_publisher_state_dir(store)
        assert pub.state_dir.startswith(f"/dev/shm/dcr-{os.geteuid()}/publish/"), pub.state_dir
        assert pub.publish(0, tmp_path / "v0")["state_dir"] == pub.state_dir
        with open(os.path.join(pub.state_dir, "lock")) as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as another publisher would
            with pytest.raises(dcr.FailedPreconditionError, match="in use by another publisher"):
                dcr.Publisher(store).publish(1, tmp_path / "v1")
        rep = pub.publish(1, tmp_path / "v1")
        assert rep["version"] == 1 and rep["advance_seconds"] > 0
        baseline = read_checkpoint(os.path.join(pub.state_dir, "baseline"))
        for n, t in vs[1].items():
            assert baseline[n].data == t.contiguous().view(torch.uint8).numpy().tobytes(), n
    finally:
        shutil.rmtree(pub.state_dir, ignore_errors=True)


# ---------------------------------------------------------------- live tensors

@pytest.mark.parametrize("mode", ["xor", "overwrite"])
def test_sender_to_receiver_over_live_tensors_is_bit_exact(mode):
    trainer = with_specials(random_tensors(20), 0)
    engine = {n: t.clone() for n, t in trainer.items()}
    ptrs = {n: t.data_ptr() for n, t in engine.items()}
    sender = dcr.Sender(trainer)
    receiver = dcr.Receiver(engine)
    assert receiver.digest() == sender.baseline_digest()
    for k in range(3):
        if k == 0:
            with_specials(trainer, 1)
        step(trainer, seed=30 + k)
        delta = sender.make_delta(mode=mode, chunk_elements=32)
        assert delta.mode == mode and delta.frame_count > 0
        report = receiver.apply(delta)
        assert report["frames_applied"] == delta.frame_count
        for n, t in trainer.items():
            assert same_bits(engine[n], t), (k, n)
            assert engine[n].data_ptr() == ptrs[n]  # applied in place, not replaced
        assert receiver.digest() == delta.target_digest
        sender.commit(delta)
        assert sender.baseline_digest() == delta.target_digest
    # Nothing changed since the commit: the next delta has no frames.
    assert sender.make_delta(mode=mode).frame_count == 0


def test_in_memory_delta_errors_and_round_trip_through_files(tmp_path):
    trainer = random_tensors(40)
    engine = {n: t.clone() for n, t in trainer.items()}
    sender = dcr.Sender(trainer)
    step(trainer, seed=41, rate=0.3)
    delta = sender.make_delta(chunk_elements=64)

    # A receiver that does not hold the base refuses, unchanged.
    stale = {n: t.clone() for n, t in engine.items()}
    step(stale, seed=42, rate=0.3)
    stale_before = {n: t.clone() for n, t in stale.items()}
    with pytest.raises(dcr.WrongBaseError):
        dcr.Receiver(stale).apply(delta)
    assert all(same_bits(stale[n], stale_before[n]) for n in stale)

    # A corrupt frame (one payload byte flipped) is caught by its checksum.
    frames = bytearray(delta.frames)
    entry = json.loads(delta.manifest_json)["frames"][0]
    frames[entry["offset"] + entry["bytes"] - 1] ^= 0x10
    bad = dcr.Delta.from_parts(delta.manifest_json, bytes(frames))
    with pytest.raises(dcr.CorruptFrameError):
        dcr.Receiver({n: t.clone() for n, t in engine.items()}).apply(bad)

    # Written as a delta directory, it is an ordinary file delta.
    delta.write(tmp_path / "d")
    with pytest.raises(dcr.AlreadyExistsError):
        delta.write(tmp_path / "d")
    assert dcr.inspect_delta(tmp_path / "d")["target_digest"] == delta.target_digest
    write_checkpoint(tmp_path / "rx", engine)
    dcr.apply_delta(tmp_path / "rx", tmp_path / "d")
    rx = dcr.Checkpoint.open(tmp_path / "rx")
    assert all(same_bits(rx.tensor(n), trainer[n]) for n in trainer)
    reread = dcr.read_delta(tmp_path / "d")
    dcr.Receiver(engine).apply(reread)
    assert all(same_bits(engine[n], trainer[n]) for n in trainer)


def test_buffers_must_be_contiguous_cpu_and_of_the_declared_dtype():
    t = {"w": torch.zeros(8, 4, dtype=torch.bfloat16)}
    layout = dcr.identity_layout(t)
    with pytest.raises(dcr.InvalidArgumentError, match="not contiguous"):
        dcr.Receiver({"w": torch.zeros(4, 8, dtype=torch.bfloat16).t()}, layout)
    with pytest.raises(dcr.InvalidArgumentError, match="buffer 'w' is F32, the layout declares BF16"):
        dcr.Receiver({"w": torch.zeros(8, 4)}, layout)
    with pytest.raises(dcr.InvalidArgumentError, match="shape"):
        dcr.Receiver({"w": torch.zeros(4, 8, dtype=torch.bfloat16)}, layout)
    with pytest.raises(dcr.InvalidArgumentError, match="not among the tensors"):
        dcr.Receiver({}, layout)
    with pytest.raises(dcr.InvalidArgumentError, match="C-contiguous"):
        dcr.byte_view(np.zeros((4, 4), np.float32)[:, ::2], "x")
    # numpy arrays are taken in place too.
    arr = np.zeros((8, 4), np.float32)
    v = dcr.byte_view(arr, "x")
    assert v.ctypes.data == arr.ctypes.data and v.nbytes == arr.nbytes
    with pytest.raises(dcr.InvalidArgumentError):
        dcr.validate_layout({"format": "dcr-layout", "format_version": 1, "tensors": [], "buffers": [],
                             "copies": [{"tensor": "x", "offset": [0], "extent": [1], "buffer": "y",
                                         "buffer_offset": [0]}]})
