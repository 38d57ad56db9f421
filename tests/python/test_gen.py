"""`dcr gen`: deterministic, self-describing (gen.json), hits the requested
change rate, and follows the Hugging Face naming of each model family."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from conftest import dcr_json, read_checkpoint, run_dcr

FAMILIES = ["llama", "qwen3-moe", "deepseek-v3"]


def file_digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def gen(out: Path, *extra, env=None) -> dict:
    return dcr_json("gen", "-o", out, "--json", *extra, env=env)


def diff_json(a, b) -> dict:
    r = run_dcr("diff", a, b, "--json", "--summary")
    assert r.returncode in (0, 1), str(r)
    return r.json()


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("family,update,shard", [("llama", "training", None), ("qwen3-moe", "stress", "300KB"),
                                                 ("deepseek-v3", "training", "300KB")])
def test_same_seed_same_bytes(tmp, family, update, shard):
    def args(seed):
        a = ["--family", family, "--size", "3MB", "--versions", "2", "--update", update, "--seed", seed]
        return a + (["--shard-size", shard] if shard else [])

    # Different thread counts must not change a bit.
    first = gen(tmp / "a", *args(42), env={"DCR_THREADS": 1})
    second = gen(tmp / "b", *args(42), env={"DCR_THREADS": 7})
    assert {k: v for k, v in first.items() if k != "out"} == {k: v for k, v in second.items() if k != "out"}
    da, db = file_digests(tmp / "a"), file_digests(tmp / "b")
    assert da == db
    assert {"gen.json", "v0/model.safetensors" if not shard else "v0/model.safetensors.index.json"} <= set(da)
    assert {k.split("/")[0] for k in da} == {"gen.json", "v0", "v1", "v2"}

    # Another seed: same structure, different bits in every version.
    third = gen(tmp / "c", *args(43))
    dc = file_digests(tmp / "c")
    assert set(dc) == set(da)
    for v in range(3):
        d = diff_json(tmp / "a" / f"v{v}", tmp / "c" / f"v{v}")
        assert not d["only_in_a"] and not d["only_in_b"] and not d["mismatched"]
        assert d["changed_elements"] > 0.5 * d["total_elements"], "a new seed should redraw the weights"
    assert third["elements_per_version"] == first["elements_per_version"]


def test_rerun_into_same_directory_overwrites(tmp):
    args = ["--family", "llama", "--size", "1MB", "--versions", "1", "--seed", "5"]
    gen(tmp / "g", *args)
    before = file_digests(tmp / "g")
    gen(tmp / "g", *args, "--shard-size", "200KB")  # a different layout leaves no stale single file
    sharded = file_digests(tmp / "g")
    assert "v0/model.safetensors" not in sharded and "v0/model.safetensors.index.json" in sharded
    assert run_dcr("inspect", tmp / "g" / "v0").returncode == 0
    gen(tmp / "g", *args)
    assert file_digests(tmp / "g") == before


# -------------------------------------------------------------------- gen.json

@pytest.mark.parametrize("family,update,rate,shard", [
    ("llama", "training", 0.03, None),
    ("qwen3-moe", "training", 0.03, "400KB"),
    ("deepseek-v3", "stress", 0.05, None),
])
def test_gen_json_matches_the_files(gen_cache, family, update, rate, shard):
    out, stdout_doc = gen_cache.get(family, update=update, rate=rate, shard_size=shard)
    doc = json.loads((out / "gen.json").read_text())
    assert doc["family"] == family and doc["update"] == update
    assert doc["rate"] == pytest.approx(rate) and doc["seed"] == 1 and doc["versions"] == 2
    assert doc["changed_per_version"] == stdout_doc["changed_per_version"]
    assert doc["elements_per_version"] == stdout_doc["elements_per_version"]
    assert doc["bytes_per_version"] == stdout_doc["bytes_per_version"]
    assert doc["shape"]["num_layers"] == stdout_doc["layers"]
    assert doc["shape"]["hidden_size"] == stdout_doc["hidden_size"]
    assert doc["shape"]["num_experts"] == stdout_doc["experts"]
    if update == "training":
        assert doc["learning_rate"] > 0
    assert len(doc["changed_per_version"]) == 2
    for v in range(3):
        ins = dcr_json("inspect", out / f"v{v}", "--json")
        assert ins["total_elements"] == doc["elements_per_version"]
        assert ins["total_bytes"] == doc["bytes_per_version"]
        assert ins["metadata"].get("format") == "pt"
    for v in range(2):
        d = diff_json(out / f"v{v}", out / f"v{v + 1}")
        assert d["changed_elements"] == doc["changed_per_version"][v], f"v{v} -> v{v + 1}"
        assert d["mismatched"] == [] and d["only_in_a"] == [] and d["only_in_b"] == []


def test_zero_versions(tmp):
    doc = gen(tmp / "g", "--family", "qwen3-moe", "--size", "1MB", "--versions", "0")
    assert doc["changed_per_version"] == []
    assert (tmp / "g" / "v0").is_dir() and not (tmp / "g" / "v1").exists()
    assert json.loads((tmp / "g" / "gen.json").read_text())["changed_per_version"] == []


def test_shape_tracks_requested_size(tmp):
    for size, lo, hi in (("1MB", 0.4e6, 2.0e6), ("6MB", 3e6, 9e6)):
        doc = gen(tmp / size, "--family", "llama", "--size", size, "--versions", "0")
        assert lo <= doc["bytes_per_version"] <= hi, (size, doc["bytes_per_version"])


# ---------------------------------------------------------------------- rates

def bf16_rate(out: Path, v: int) -> tuple[float, int]:
    """Fraction of BF16 elements whose bits changed from v to v+1."""
    r = run_dcr("diff", out / f"v{v}", out / f"v{v + 1}", "--json")
    doc = r.json()
    bf = [t for t in doc["tensors"] if t["dtype"] == "BF16"]
    n = sum(t["elements"] for t in bf)
    assert n > 0.9 * doc["total_elements"], "these models should be BF16-dominated"
    return sum(t["changed_elements"] for t in bf) / n, n


@pytest.mark.parametrize("family,update,rate,tolerance", [
    ("llama", "training", 0.03, 0.20),
    ("llama", "training", 0.01, 0.20),
    ("qwen3-moe", "training", 0.05, 0.20),
    ("deepseek-v3", "training", 0.03, 0.20),
    ("llama", "stress", 0.03, 0.05),
    ("qwen3-moe", "stress", 0.05, 0.05),
    ("deepseek-v3", "stress", 0.03, 0.05),
    ("deepseek-v3", "stress", 0.2, 0.05),
])
def test_requested_rate_is_hit(gen_cache, family, update, rate, tolerance):
    out, _ = gen_cache.get(family, update=update, rate=rate)
    for v in range(2):
        got, n = bf16_rate(out, v)
        assert abs(got - rate) <= tolerance * rate, f"{family}/{update}: asked {rate}, got {got:.5f} over {n} BF16"


def test_training_changes_small_weights_more_often(gen_cache):
    """The training model's signature: norms near 1.0 change far less than N(0, 0.02) weights."""
    out, _ = gen_cache.get("llama", update="training", rate=0.03)
    doc = run_dcr("diff", out / "v0", out / "v1", "--json").json()
    t = {x["name"]: x for x in doc["tensors"]}
    norm = [x for n, x in t.items() if n.endswith("norm.weight")]
    weights = [x for n, x in t.items() if n.endswith("proj.weight")]
    norm_rate = sum(x["changed_elements"] for x in norm) / sum(x["elements"] for x in norm)
    weight_rate = sum(x["changed_elements"] for x in weights) / sum(x["elements"] for x in weights)
    assert norm_rate < 0.5 * weight_rate, (norm_rate, weight_rate)
    # Training updates are tiny: mostly the mantissa moves; signs flip only for weights next to zero.
    assert doc["mantissa_changed"] > 0.95 * doc["changed_elements"]
    assert doc["exponent_changed"] < 0.05 * doc["changed_elements"]
    assert doc["sign_changed"] < 0.01 * doc["changed_elements"]
    # F32 tensors (DeepSeek-V3 norms and router bias) see the FP32 step itself: they change almost everywhere.
    out, _ = gen_cache.get("deepseek-v3", update="training", rate=0.03)
    doc = run_dcr("diff", out / "v0", out / "v1", "--json").json()
    f32 = [x for x in doc["tensors"] if x["dtype"] == "F32"]
    assert f32 and sum(x["changed_elements"] for x in f32) > 0.8 * sum(x["elements"] for x in f32)


def test_stress_changes_every_dtype_at_the_rate(gen_cache):
    out, _ = gen_cache.get("deepseek-v3", update="stress", rate=0.2)
    doc = run_dcr("diff", out / "v0", out / "v1", "--json").json()
    for dtype in ("BF16", "F32"):
        ts = [t for t in doc["tensors"] if t["dtype"] == dtype]
        n = sum(t["elements"] for t in ts)
        c = sum(t["changed_elements"] for t in ts)
        assert abs(c / n - 0.2) < 0.2 * 0.2 if dtype == "F32" else abs(c / n - 0.2) < 0.05 * 0.2, (dtype, c, n)


# ---------------------------------------------------------------------- dtypes

def test_deepseek_v3_has_f32_norms_and_router_bias(gen_cache):
    out, _ = gen_cache.get("deepseek-v3")
    tensors = dcr_json("inspect", out / "v0", "--json")["tensors"]
    f32 = {t["name"] for t in tensors if t["dtype"] == "F32"}
    expect = {t["name"] for t in tensors
              if t["name"].endswith(("norm.weight", "layernorm.weight", ".mlp.gate.e_score_correction_bias"))}
    assert f32 == expect
    assert "model.norm.weight" in f32
    assert any(n.endswith(".mlp.gate.e_score_correction_bias") for n in f32)
    assert any(n.endswith(".self_attn.kv_a_layernorm.weight") for n in f32)
    assert {t["dtype"] for t in tensors} == {"BF16", "F32"}
    for t in tensors:
        if t["name"].endswith("e_score_correction_bias"):
            assert t["shape"] == [json.loads((out / "gen.json").read_text())["shape"]["num_experts"]]


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_other_families_are_all_bf16(gen_cache, family):
    out, _ = gen_cache.get(family)
    assert {t["dtype"] for t in dcr_json("inspect", out / "v0", "--json")["tensors"]} == {"BF16"}


# ----------------------------------------------------------------------- names

def _hf_checkpoint_keys(family: str, tmp_path: Path) -> set[str]:
    """Tensor names of a tiny randomly initialised transformers model, as save_pretrained writes them."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    common = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, vocab_size=64,
                  intermediate_size=64, tie_word_embeddings=False)
    if family == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=1, **common)
    elif family == "qwen3-moe":
        cfg = transformers.Qwen3MoeConfig(num_key_value_heads=1, head_dim=16, num_experts=3, num_experts_per_tok=2,
                                          moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[],
                                          **common)
    else:
        cfg = transformers.DeepseekV3Config(
            num_key_value_heads=2, n_routed_experts=3, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / family)
    return set(read_checkpoint(tmp_path / family / "model.safetensors"))


def name_patterns(names: set[str]) -> set[str]:
    """Names modulo layer and expert indices; a layer's pattern says whether it is dense or MoE."""
    moe_layers = {m.group(1) for n in names if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", n))}
    out = set()
    for n in names:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", n)
        if m:
            kind = "moe" if m.group(1) in moe_layers else "dense"
            n = f"model.layers.<{kind}>." + re.sub(r"experts\.\d+\.", "experts.<e>.", m.group(2))
        out.add(n)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_names_follow_hugging_face(gen_cache, tmp, family):
    out, _ = gen_cache.get(family)
    ours = set(read_checkpoint(out / "v0"))
    hf = _hf_checkpoint_keys(family, tmp)
    assert name_patterns(ours) == name_patterns(hf)
    # Index ranges are contiguous from 0.
    shape = json.loads((out / "gen.json").read_text())["shape"]
    layers = {int(m.group(1)) for n in ours if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    assert layers == set(range(shape["num_layers"]))
    experts = {int(m.group(1)) for n in ours if (m := re.search(r"\.experts\.(\d+)\.", n))}
    assert experts == set(range(shape["num_experts"]))
    if family == "deepseek-v3":
        dense = {int(m.group(1)) for n in ours if (m := re.match(r"model\.layers\.(\d+)\.mlp\.gate_proj", n))}
        assert dense == set(range(shape["first_dense_layers"]))
