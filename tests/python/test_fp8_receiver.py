"""An FP8 engine rank in the Python API (dcr.Receiver with ``fp8``): its
block-FP8 weights follow a BF16 trainer through the ordinary deltas (the
bytes a BF16 engine gets), and after every version each E4M3 weight and
scale equals, bit for bit, the block-FP8 quantization of the trainer's BF16
tensors of that version (an independent torch reference, and
dcr.quantize_fp8_blocks). The engine's map is what a tracer of an FP8 engine
records (F8_E4M3 declarations), with a fused buffer whose last block row is
an edge block, an expert stack and a plain BF16 norm.
"""

from __future__ import annotations

import json

import pytest
import torch

import dcr
from dcr.errors import FailedPreconditionError, InvalidArgumentError

from conftest import following, run_dcr
from test_fp8_quantizer import reference

SHAPES = {"q": [256, 200], "k": [100, 200], "o": [200, 256], "e0": [128, 256], "e1": [128, 256], "norm": [200]}
FP8 = {"qk": [356, 200], "o": [200, 256], "experts": [2, 128, 256]}


def engine_layout() -> dict:
    tensors = [{"name": n, "dtype": "BF16" if n == "norm" else "F8_E4M3", "shape": s} for n, s in SHAPES.items()]
    buffers = [{"id": b, "dtype": "F8_E4M3", "shape": s} for b, s in FP8.items()]
    buffers.append({"id": "norm", "dtype": "BF16", "shape": [200]})

    def copy(t, buffer, at):
        return {"tensor": t, "offset": [0] * len(SHAPES[t]), "extent": SHAPES[t], "buffer": buffer,
                "buffer_offset": at}
    copies = [copy("q", "qk", [0, 0]), copy("k", "qk", [256, 0]), copy("o", "o", [0, 0]),
              copy("e0", "experts", [0, 0, 0]), copy("e1", "experts", [1, 0, 0]), copy("norm", "norm", [0])]
    return {"format": "dcr-layout", "format_version": 1, "tensors": tensors, "buffers": buffers, "copies": copies}


def engine_buffers(canonical: dict) -> dict:
    """What each FP8 buffer holds in BF16: the canonical tensors placed."""
    return {"qk": torch.cat([canonical["q"], canonical["k"]]), "o": canonical["o"],
            "experts": torch.stack([canonical["e0"], canonical["e1"]])}


def expected(canonical: dict) -> dict:
    """Per FP8 buffer: (E4M3 bits, scales) of the torch reference quantization."""
    out = {}
    for b, bf16 in engine_buffers(canonical).items():
        parts = [reference(x) for x in (bf16 if bf16.dim() == 3 else [bf16])]
        q = torch.stack([p[0] for p in parts]) if bf16.dim() == 3 else parts[0][0]
        s = torch.stack([p[1] for p in parts]) if bf16.dim() == 3 else parts[0][1]
        out[b] = (q.view(torch.uint8), s)
    return out


def make_engine():
    tensors = {b: torch.zeros(s, dtype=torch.float8_e4m3fn) for b, s in FP8.items()}
    tensors["norm"] = torch.zeros(200, dtype=torch.bfloat16)
    scales = {b: torch.zeros(s[:-2] + [(s[-2] + 127) // 128, (s[-1] + 127) // 128]) for b, s in FP8.items()}
    return tensors, scales


def expect_engine(tensors: dict, scales: dict, canonical: dict, when: str):
    for b, (q, s) in expected(canonical).items():
        assert torch.equal(tensors[b].view(torch.uint8), q), f"{when}: E4M3 bits of {b}"
        assert torch.equal(scales[b].view(torch.int32), s.view(torch.int32)), f"{when}: scales of {b}"
        mine_q, mine_s = (dcr.quantize_fp8_blocks(engine_buffers(canonical)[b]) if b != "experts" else (None, None))
        if mine_q is not None:
            assert torch.equal(mine_q.view(torch.uint8), q) and torch.equal(mine_s, s), f"{when}: {b} vs dcr"
    assert torch.equal(tensors["norm"].view(torch.int16), canonical["norm"].view(torch.int16)), when


def test_an_fp8_rank_follows_bf16_training_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    master = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
    params = [torch.nn.Parameter(t) for t in master.values()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    canonical = {n: p.detach().to(torch.bfloat16) for n, p in zip(master, params)}
    live = {n: t.clone() for n, t in canonical.items()}  # the trainer's BF16 weights, updated in place
    trainer = dcr.Sender(live)

    tensors, scales = make_engine()
    rx = dcr.Receiver(tensors, engine_layout(), fp8=scales)
    rx.load(canonical)  # the BF16 checkpoint of version 0: every block quantized
    expect_engine(tensors, scales, canonical, "version 0")
    bf16_engine = dcr.Receiver({n: t.clone() for n, t in canonical.items()})

    for version in range(1, 4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        canonical = {n: p.detach().to(torch.bfloat16) for n, p in zip(master, params)}
        for n, t in canonical.items():
            live[n].copy_(t)
        delta = trainer.make_delta()
        report = rx.apply(delta)
        assert report["frames_applied"] > 0 and report["fp8_blocks_requantized"] > 0, report
        assert report["fp8_master_bytes"] == 2 * sum(torch.Size(s).numel() for s in FP8.values())
        expect_engine(tensors, scales, canonical, f"version {version}")
        # A BF16 engine applies the same delta: the same bytes, the same digest.
        bf16_engine.apply(delta)
        assert rx.digest() == bf16_engine.digest()
        trainer.commit(delta)


def test_bad_fp8_engines_are_refused():
    tensors, scales = make_engine()
    bad = dict(scales)
    bad["o"] = torch.zeros(3, 3)
    with pytest.raises(InvalidArgumentError, match="scales of FP8 buffer 'o'"):
        dcr.Receiver(tensors, engine_layout(), fp8=bad)
    wrong = dict(tensors)
    wrong["o"] = torch.zeros(200, 256, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="FP8 buffer 'o' is BF16"):
        dcr.Receiver(wrong, engine_layout(), fp8=scales)
    layout = engine_layout()
    layout["copies"][1]["buffer_offset"] = [257, 0]  # k starts mid-block
    layout["buffers"][0]["shape"] = [357, 200]
    tensors["qk"] = torch.zeros(357, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(InvalidArgumentError, match="not aligned to 128-element blocks"):
        dcr.Receiver(tensors, layout, fp8=scales)
    with pytest.raises(InvalidArgumentError, match="does not declare"):
        dcr.Receiver(make_engine()[0], engine_layout(), fp8={"nope": torch.zeros(1, 1)})


def test_an_fp8_rank_joins_from_the_snapshot_and_follows_the_run(tmp_path):
    """Receiver.follow with ``fp8``: the rank joins from the run's BF16
    snapshot into its master (every block quantized), and at every version
    its FP8 weights hold that version when post_update sees it (they are
    requantized before the ack)."""
    g = torch.Generator().manual_seed(2)
    trainer = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [trainer], ack_timeout_s=60)
    pub.publish_snapshot(trainer)
    published = {0: {n: t.clone() for n, t in trainer.items()}}

    tensors, scales = make_engine()
    seen: list = []

    def check(report):
        v = report["version"]
        expect_engine(tensors, scales, published[v], f"version {v} at post_update")
        seen.append(v)

    rx = dcr.Receiver(tensors, engine_layout(), fp8=scales, post_update=check)
    with following(rx, store, tmp_path / "rx", engine="fp8", until=2, timeout_s=60, poll_s=0.02) as result:
        for v in (1, 2):
            for n in trainer:
                flat = trainer[n].view(-1)
                flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 40]] *= 1.5
            published[v] = {n: x.clone() for n, x in trainer.items()}
            assert pub.publish(v)["acked"] == ["fp8-r0"]
    assert result == [2], result
    assert seen == [0, 1, 2]
    expect_engine(tensors, scales, published[2], "after following")
    # Its record says the host memory of its master: dcr status shows it.
    master = 2 * sum(torch.Size(s).numel() for s in FP8.values())
    status = run_dcr("status", "--store", f"file://{tmp_path}/store", "--json").json()
    assert [(x["id"], x["master_bytes"]) for x in status["receivers"]] == [("fp8-r0", master)], status["receivers"]
    text = run_dcr("status", "--store", f"file://{tmp_path}/store").stdout
    assert "keeps a BF16 master of" in text, text


def test_the_run_names_its_fp8_scheme_and_an_fp8_rank_refuses_another(tmp_path):
    """Every run a publisher creates names the FP8 scheme of its FP8 engines
    (run.json "fp8"); an FP8 rank of a run that names another scheme (a dcr
    that quantizes otherwise) refuses to follow it, naming both; a BF16
    engine of that run follows it."""
    g = torch.Generator().manual_seed(3)
    trainer = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    store = dcr.open_store(f"file://{tmp_path}/store")
    dcr.ShardPublisher(store, tmp_path / "trainer", [trainer]).publish_snapshot(trainer)
    run = json.loads(store.get("run.json"))
    assert run["fp8"] == {
        "format": "e4m3fn", "block_rows": 128, "block_cols": 128,
        "scale": "f32 weight_scale_inv = amax / 448 over the block's finite magnitudes; 1 when it has none",
        "rounding": "nearest, ties to even; subnormals kept",
        "specials": "NaN stays NaN; infinities and magnitudes above 448 saturate to 448"}, run["fp8"]

    run["fp8"]["block_rows"] = 64
    store.put("run.json", json.dumps(run).encode())
    tensors, scales = make_engine()
    with pytest.raises(FailedPreconditionError, match=r"quantizes its FP8 engines as .*\"block_rows\":64"):
        dcr.Receiver(tensors, engine_layout(), fp8=scales).follow(store, tmp_path / "fp8", engine="fp8", until=0,
                                                                  timeout_s=60)
    assert not tensors["o"].view(torch.uint8).any(), "the refused rank wrote its buffers"
    bf16 = dcr.Receiver({n: torch.zeros_like(t) for n, t in trainer.items()})
    assert bf16.follow(store, tmp_path / "bf16", engine="bf16", until=0, timeout_s=60) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (scripts/device_check.sh runs it on a GPU)"))])
def test_an_fp8_rank_through_torch_as_on_a_device(device):
    """The FP8 engine's tensors reached only through torch (TensorMemory:
    CUDA tensors, or CPU ones with stage=True): the norm by index copies, the
    requantized E4M3 weights and scales copied in from host copies after
    every apply. Bit for bit as the host path."""
    g = torch.Generator().manual_seed(4)
    canonical = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    live = {n: t.clone() for n, t in canonical.items()}
    trainer = dcr.Sender(live)
    tensors, scales = make_engine()
    tensors = {n: t.to(device) for n, t in tensors.items()}
    scales = {n: s.to(device) for n, s in scales.items()}
    rx = dcr.Receiver(tensors, engine_layout(), fp8=scales, stage=True)
    rx.load(canonical)

    def on_host(d: dict) -> dict:
        return {n: t.cpu() for n, t in d.items()}
    expect_engine(on_host(tensors), on_host(scales), canonical, "version 0")
    for version in (1, 2):
        for n in live:
            flat = live[n].view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 30]] *= -1
        delta = trainer.make_delta()
        report = rx.apply(delta)
        assert report["fp8_blocks_requantized"] > 0
        expect_engine(on_host(tensors), on_host(scales), live, f"version {version}")
        trainer.commit(delta)
