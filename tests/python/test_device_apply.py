"""The apply loop on tensors where they live (dcr._tensors.TensorMemory, the
path of CUDA tensors): the same deltas applied to tensors on a device and to
host tensors in place give the same bits, digests and reports. On CUDA where
a GPU is present (scripts/device_check.sh runs these there); everywhere on
the CPU through the same torch index copies (stage=True).

Covered: every mode (xor, add, overwrite) and codec (sparse, dense: most
words changed), dtypes of 1, 2, 4 and 8-byte words, special bit patterns
(+0/-0, NaN payloads, infinities, subnormals), chunk edges (tensors whose
sizes are not a multiple of the chunk), a layout with replicas and chunks
split between buffers, a scatter that fails part way (torn) repaired by an
overwrite, and a rank following a store through an overwrite retry."""

from __future__ import annotations

import json

import pytest
import torch

import dcr

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
CHUNK = 64  # elements: chunk edges everywhere below

DTYPES = {"bf": torch.bfloat16, "f32": torch.float32, "f8": torch.float8_e4m3fn, "f64": torch.float64}
SHAPES = {"bf": (37, 11), "f32": (150,), "f8": (9, 29), "f64": (70,)}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32,
                                                                       8: torch.int64}[t.element_size()])


def specials(dtype: torch.dtype) -> list:
    """Bit patterns that float comparisons get wrong."""
    w = {1: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x81], 2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001],
         4: [0, 0x80000000, 0x7F800000, 0x7FC00001, 0x00000001, 0x807FFFFF],
         8: [0, 1 << 63, 0x7FF0000000000000, 0x7FF8000000000001, 1, 0x800FFFFFFFFFFFFF]}
    return w[torch.tensor([], dtype=dtype).element_size()]


def model(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(SHAPES[n], generator=gen).to(DTYPES[n]) for n in DTYPES}


def step(tensors: dict, gen: torch.Generator, rate: float) -> None:
    """Changes about `rate` of each tensor's words: random bits and specials."""
    for t in tensors.values():
        words = bits(t).view(-1)
        n = max(1, int(words.numel() * rate))
        at = torch.randperm(words.numel(), generator=gen)[:n]
        pool = specials(t.dtype)
        new = torch.randint(-(1 << 15), 1 << 15, (n,), generator=gen).to(words.dtype)
        for k in range(0, n, 3):
            new[k] = torch.tensor(pool[k % len(pool)]).to(torch.int64).to(words.dtype)
        words[at] = new
        t.view(-1).copy_(words.view(t.dtype))


def on(tensors: dict, device: str) -> dict:
    return {n: t.clone().to(device) for n, t in tensors.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_on_a_device_end_as_host_tensors_do_in_every_mode(device):
    trainer = model(1)
    tx = dcr.Sender(trainer)
    host = on(trainer, "cpu")
    live = on(trainer, device)
    rx_host = dcr.Receiver(host, stage=False)
    rx_dev = dcr.Receiver(live, stage=True)
    addresses = {n: t.data_ptr() for n, t in live.items()}
    gen = torch.Generator().manual_seed(2)
    seen = set()
    for v, (rate, mode) in enumerate([(0.02, "xor"), (0.3, "xor"), (0.9, "xor"), (0.05, "overwrite"),
                                      (0.95, "overwrite"), (0.01, "xor")], start=1):
        step(trainer, gen, rate)
        delta = tx.make_delta(mode=mode, chunk_elements=CHUNK)
        frames = json.loads(delta.manifest_json)["frames"]
        seen |= {(f["mode"], f["codec"]) for f in frames}
        a, b = rx_host.apply(delta), rx_dev.apply(delta)
        for k in ("frames_applied", "frames_already_applied", "payload_bytes", "changed_words"):
            assert a[k] == b[k], (v, k, a, b)
        for n in trainer:
            assert torch.equal(bits(live[n]), bits(trainer[n])), (v, n)
            assert torch.equal(bits(host[n]), bits(trainer[n])), (v, n)
        assert rx_dev.digest() == rx_host.digest() == delta.target_digest
        tx.commit(delta)
    assert {n: t.data_ptr() for n, t in live.items()} == addresses, "written in place, storage kept"
    assert {("xor", "sparse"), ("add", "sparse"), ("overwrite", "sparse")} <= seen, seen
    assert any(codec != "sparse" for _, codec in seen), seen


def replicated_layout() -> dict:
    """Canonical "w" [12, 10] split by rows into two buffers, rows 4..7 also
    in a replica; "b" [10] whole. Chunks of 16 elements straddle the boxes."""
    return {"format": "dcr-layout", "format_version": 1,
            "tensors": [{"name": "w", "dtype": "BF16", "shape": [12, 10]}, {"name": "b", "dtype": "F32", "shape": [10]}],
            "buffers": [{"id": "top", "dtype": "BF16", "shape": [6, 10]}, {"id": "bottom", "dtype": "BF16", "shape": [6, 10]},
                        {"id": "mid", "dtype": "BF16", "shape": [5, 10]}, {"id": "b", "dtype": "F32", "shape": [10]}],
            "copies": [{"tensor": "w", "offset": [0, 0], "extent": [6, 10], "buffer": "top", "buffer_offset": [0, 0]},
                       {"tensor": "w", "offset": [6, 0], "extent": [6, 10], "buffer": "bottom", "buffer_offset": [0, 0]},
                       {"tensor": "w", "offset": [4, 0], "extent": [4, 10], "buffer": "mid", "buffer_offset": [1, 0],
                        "primary": False},
                       {"tensor": "b", "offset": [0], "extent": [10], "buffer": "b", "buffer_offset": [0]}]}


def placed(canonical: dict, device: str) -> dict:
    w = canonical["w"]
    mid = torch.zeros(5, 10, dtype=w.dtype)
    mid[1:] = w[4:8]
    return {"top": w[:6].clone().to(device), "bottom": w[6:].clone().to(device), "mid": mid.to(device),
            "b": canonical["b"].clone().to(device)}


@pytest.mark.parametrize("device", DEVICES)
def test_a_layout_with_replicas_and_split_chunks_is_placed_on_the_device(device):
    gen = torch.Generator().manual_seed(3)
    trainer = {"w": torch.randn(12, 10, generator=gen).to(torch.bfloat16), "b": torch.randn(10, generator=gen)}
    tx = dcr.Sender(trainer)
    layout = replicated_layout()
    host, live = placed(trainer, "cpu"), placed(trainer, device)
    rx_host = dcr.Receiver(host, layout, stage=False)
    rx_dev = dcr.Receiver(live, layout, stage=True)
    for v, mode in enumerate(["xor", "overwrite", "xor"], start=1):
        step(trainer, gen, 0.3)
        delta = tx.make_delta(mode=mode, chunk_elements=16)
        assert rx_host.apply(delta)["changed_words"] == rx_dev.apply(delta)["changed_words"]
        want = placed(trainer, "cpu")
        for n in want:
            assert torch.equal(bits(live[n]), bits(want[n])), (v, n)
            assert torch.equal(bits(host[n]), bits(want[n])), (v, n)
        assert rx_dev.digest() == delta.target_digest
        tx.commit(delta)


@pytest.mark.parametrize("device", DEVICES)
def test_a_scatter_that_fails_part_way_is_repaired_by_the_overwrite_retry(device):
    trainer = model(5)
    tx = dcr.Sender(trainer)
    live = on(trainer, device)
    rx = dcr.Receiver(live, stage=True)
    memory = rx._memory
    real, calls = memory.scatter, []

    def failing(requests):  # the second window's scatter: its first request lands, then the device fails
        calls.append(len(requests))
        if len(calls) == 2:
            real(requests[:1])
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        real(requests)

    memory.scatter = failing
    step(trainer, torch.Generator().manual_seed(6), 0.5)
    xor = tx.make_delta(chunk_elements=CHUNK)
    with pytest.raises(dcr.InternalError, match="injected"):
        rx.apply(xor)
    assert len(calls) >= 2
    memory.scatter = real
    # The version is half applied (some chunks whole, one torn); its overwrite
    # retry, digested from the bits again, brings every tensor to it.
    overwrite = tx.make_delta(mode="overwrite", chunk_elements=CHUNK)
    report = rx.apply(overwrite)
    assert report["frames_already_applied"] > 0, report
    for n in trainer:
        assert torch.equal(bits(live[n]), bits(trainer[n])), n
    assert rx.digest() == overwrite.target_digest


@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_on_the_device_follows_a_store_through_an_overwrite_retry(tmp_path, device):
    trainer = model(7)
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [trainer], ack_timeout_s=30, chunk_elements=CHUNK,
                             inject_failures=["frames-written:2"])
    pub.publish_snapshot(trainer)
    live = {n: torch.zeros(t.shape, dtype=t.dtype, device=device) for n, t in trainer.items()}
    rx = dcr.Receiver(live, stage=True)
    assert rx.follow(store, tmp_path / "rx", engine="e", until=0, timeout_s=30, poll_s=0.02) == 0
    gen = torch.Generator().manual_seed(8)
    import threading

    for v in (1, 2, 3):
        step(trainer, gen, 0.03)
        done = []
        t = threading.Thread(target=lambda: done.append(rx.follow(store, tmp_path / "rx", engine="e", until=v,
                                                                  timeout_s=60, poll_s=0.02)))
        t.start()
        report = pub.publish(v)
        t.join(90)
        assert done == [v], done
        assert report["attempts"] == (2 if v == 2 else 1), report
        for n in trainer:
            assert torch.equal(bits(live[n]), bits(trainer[n])), (v, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", [False, True], ids=["host", "staged"])
def test_bits_changed_behind_dcrs_back_between_follows_are_named_and_repaired(tmp_path, device, stage):
    # A word of a live tensor written by something other than dcr after
    # version 0: the next follow's recheck names its chunk and the rank
    # rejoins, so version 1 is acked and returned over exactly its bits.
    if device != "cpu" and not stage:
        pytest.skip("tensors on a device are only reached staged")
    trainer = model(9)
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [trainer], ack_timeout_s=30, chunk_elements=CHUNK)
    pub.publish_snapshot(trainer)
    live = {n: torch.zeros(t.shape, dtype=t.dtype, device=device) for n, t in trainer.items()}
    rx = dcr.Receiver(live, stage=stage)
    assert rx.follow(store, tmp_path / "rx", engine="e", until=0, timeout_s=30, poll_s=0.02) == 0
    name = max(live, key=lambda n: live[n].numel())
    word = live[name].view(-1)[CHUNK + 1:CHUNK + 2]  # the tensor's second chunk, in place
    word.copy_(bits(word).bitwise_xor(0x40).view(word.dtype).to(device))
    import threading

    step(trainer, torch.Generator().manual_seed(10), 0.03)
    done = []
    t = threading.Thread(target=lambda: done.append(rx.follow(store, tmp_path / "rx", engine="e", until=1,
                                                              timeout_s=60, poll_s=0.02)))
    t.start()
    report = pub.publish(1)
    t.join(90)
    assert done == [1] and report["acked"] == ["e-r0"], (done, report)
    assert rx.outside_changes.startswith(f"tensor '{name}' chunk 1 (elements {CHUNK}..{2 * CHUNK - 1})"), \
        rx.outside_changes
    for n in trainer:
        assert torch.equal(bits(live[n]), bits(trainer[n])), n
