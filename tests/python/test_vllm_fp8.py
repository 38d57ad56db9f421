"""A block-FP8 vLLM engine follows a BF16 trainer through the dcr backend
(tests/python/vllm_fp8_job.py): vLLM's own model and model loader on a
block-FP8 checkpoint, less the FP8 GEMM kernel (which needs AMX on CPU), so
it runs everywhere; a forward pass is not part of it. After every version
each E4M3 weight and scale equals, bit for bit, vLLM's load of the block-FP8
checkpoint made from the trainer's BF16 checkpoint of that version."""

from __future__ import annotations

import os
import re

import pytest

if os.environ.get("DCR_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from test_vllm import run_job  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "vllm_fp8_job.py")
STEPS = 3


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_block_fp8_engine_follows_bf16_training_bit_exact(tmp_path, family):
    r = run_job(tmp_path, family, "--work", str(tmp_path), "--store", f"file://{tmp_path}/store",
                "--family", family, "--steps", str(STEPS), job=JOB)

    # Every projection is an E4M3 weight dcr requantizes from its BF16 master
    # (2 bytes per element, on the host); no tensor is a residual, so the
    # engine reads the version's ordinary frames, as the BF16 engine does.
    join = r["join"]
    fp8 = join["fp8_weights"]
    assert any(n.endswith("qkv_proj.weight") for n in fp8) and any(n.endswith("o_proj.weight") for n in fp8), fp8
    experts = [n for n in fp8 if n.endswith(("w13_weight", "w2_weight"))]
    assert (len(experts) == 4) == (family == "qwen3-moe"), fp8
    assert join["residuals"] == [] and join["adopted"] is None, join  # E4M3 holds no master: joined from the snapshot
    assert join["fp8_master_bytes"] > 0 and join["host_bytes"] > join["fp8_master_bytes"], join
    assert all(join["host_layers"][n.rpartition(".")[0]].startswith("block FP8") for n in fp8), join["host_layers"]

    versions = r["versions"]
    assert [v["version"] for v in versions] == list(range(STEPS + 1))
    for v in versions:
        engine, fresh = v["engine"], v["fresh"]
        assert engine.keys() == fresh.keys() and any(n.endswith("weight_scale_inv") for n in engine)
        differ = sorted(n for n in engine if engine[n] != fresh[n])
        assert not differ, f"version {v['version']}: differs from vLLM's load of the FP8 checkpoint: {differ[:5]}"
        assert v["bf16_same"], v["version"]
        if v["version"] > 0:
            prev = versions[v["version"] - 1]["engine"]
            moved = [n for n in engine if engine[n] != prev[n]]
            assert any(n in fp8 for n in moved), moved  # (small steps rarely move a block's amax: its scale)
            assert v["report"]["acked"] == ["bf16-r0", "fp8-r0"], v["report"]
            # The ordinary delta, not the FP8 tensors resent whole.
            assert 0 < v["report"]["frame_bytes"] < r["total_bytes"] / 5, (v["report"], r["total_bytes"])
    # Version 2's first attempt failed after both engines acked it: the retry overwrote what they held.
    assert [v["report"]["attempts"] for v in versions[1:]] == [1, 2, 1]
    # A block that became all zeros: E4M3 zeros, scale 1; then a block whose amax tripled.
    assert versions[2]["blocks"][0] == {"scale": 1.0, "zero_bytes": True}, versions[2]["blocks"]
    ratio = versions[3]["blocks"][1]["scale"] / versions[2]["blocks"][1]["scale"]
    assert abs(ratio - 3) < 0.05, versions[2:]
    o_proj = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    assert versions[3]["engine"][o_proj] != versions[2]["engine"][o_proj]
    assert r["bf16_result"] == f"[{STEPS}]", r["bf16_result"]
    # Each engine's record in the store (what dcr status shows): the FP8 engine's master beside the BF16 engine's none.
    masters = {i: x.get("master_bytes") for i, x in r["receivers"].items()}
    assert masters == {"fp8-r0": join["fp8_master_bytes"], "bf16-r0": 0}, masters
    # The same frames reached both: the frame bytes each held for the last version are the same.
    held = {i: x["frames_held_bytes"] for i, x in r["receivers"].items()}
    assert held["fp8-r0"] == held["bf16-r0"] > 0, held
    # The live parameters against vLLM's model loader on the last version's FP8 checkpoint.
    assert r["live"] == r["fresh_live"]


def test_quantized_layers_dcr_cannot_follow_are_refused_with_the_reason():
    """Init refuses a layer whose quantization dcr does not reproduce, naming
    why (the method is judged by its vLLM class name and attributes)."""
    from dcr.vllm import _why_not_supported

    def method(kind: str, e8m0: bool = False, **attrs):
        return type(kind, (), dict(attrs, quant_config=type("Cfg", (), {"is_scale_e8m0": e8m0})()))()

    block = dict(block_quant=True, weight_block_size=[128, 128])
    assert _why_not_supported(method("Fp8LinearMethod", **block)) is None
    assert _why_not_supported(method("Fp8MoEMethod", **block)) is None
    assert _why_not_supported(method("UnquantizedLinearMethod")) is None
    cases = {"per-tensor FP8 is not supported": method("Fp8LinearMethod", block_quant=False, weight_block_size=None),
             "FP8 blocks of [64, 64]": method("Fp8MoEMethod", block_quant=True, weight_block_size=[64, 64]),
             "UE8M0 block scales": method("Fp8LinearMethod", e8m0=True, **block),
             "supports unquantized and block-FP8 models": method("AWQLinearMethod")}
    for why, qm in cases.items():
        assert why in (_why_not_supported(qm) or ""), (why, _why_not_supported(qm))


def test_fp8_weights_must_have_block_scales_and_be_placed_whole():
    """What init checks of an E4M3 weight, on a model of one fake block-FP8
    layer: the trace places a BF16 box copied into it (an F32 one is
    residual); its weight_scale_inv must be F32, one per 128 x 128 block; the
    loader must place every element of it from BF16 run tensors."""
    import torch

    from dcr.trace import record_layout
    from dcr.vllm import _LoadForm

    class Fp8LinearMethod:  # judged by its class name and attributes, as vLLM's
        block_quant, weight_block_size = True, [128, 128]
        quant_config = type("Cfg", (), {"is_scale_e8m0": False})()

    def model(scale_shape=(2, 1), scale_dtype=torch.float32, scales=True):
        layer = torch.nn.Module()
        layer.quant_method = Fp8LinearMethod()
        layer.weight = torch.nn.Parameter(torch.zeros(256, 128, dtype=torch.float8_e4m3fn), requires_grad=False)
        if scales:
            layer.weight_scale_inv = torch.nn.Parameter(torch.ones(scale_shape, dtype=scale_dtype), requires_grad=False)
        m = torch.nn.Module()
        m.proj = layer
        return m

    form = _LoadForm(model())
    assert form.fp8_scales == {"proj.weight": "proj.weight_scale_inv"}
    for bad, why in [(dict(scale_shape=(2, 2)), "expected float32 [2, 1]"),
                     (dict(scale_dtype=torch.bfloat16), "expected float32 [2, 1]"),
                     (dict(scales=False), "without block scales")]:
        with pytest.raises(NotImplementedError, match=re.escape(why)):
            _LoadForm(model(**bad))

    def loader(weights):  # the top half of the weight from "top", the bottom from "bottom"
        for name, w in weights:
            rows = slice(0, 128) if name == "top" else slice(128, 256)
            form.slots["proj.weight"].host[rows].copy_(w)

    weights = {"top": torch.zeros(128, 128, dtype=torch.bfloat16), "bottom": torch.zeros(128, 128)}
    layout, residuals = record_layout(form.tensors, loader, weights)
    assert residuals == ["bottom"] and [c["tensor"] for c in layout["copies"]] == ["top"], (layout, residuals)
    assert {b["id"]: b["dtype"] for b in layout["buffers"]}["proj.weight"] == "F8_E4M3"
    with pytest.raises(NotImplementedError, match="places 16384 of the 32768 elements of E4M3 weight 'proj.weight'"):
        form.fp8_targets(layout)
    weights["bottom"] = weights["bottom"].to(torch.bfloat16)
    layout, residuals = record_layout(form.tensors, loader, weights)
    assert residuals == [] and set(form.fp8_targets(layout)) == {"proj.weight"}
