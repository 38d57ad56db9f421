"""dcr layout generate|validate|show: maps generated for the checkpoints dcr
gen writes validate against them (checked here with the standard library's
JSON, independent of dcr's parser); broken maps exit 2 with the entry named."""

from __future__ import annotations

import json

import pytest

from conftest import assert_no_crash, run_dcr


def generate(tmp_path, *args):
    out = tmp_path / "map.json"
    r = run_dcr("layout", "generate", "--size", "2MB", *args, "-o", out)
    assert r.returncode == 0, r
    return out, json.loads(out.read_text())


@pytest.mark.parametrize("args", [
    ["--side", "vllm", "--family", "llama", "--tp", "2", "--rank", "1"],
    ["--side", "vllm", "--family", "qwen3-moe", "--tp", "2", "--expert-parallel"],
    ["--side", "megatron", "--family", "deepseek-v3", "--tp", "2", "--ep", "2", "--expert-tp", "--ep-rank", "1"],
])
def test_generated_maps_validate_against_the_checkpoint(tmp_path, args):
    family = args[args.index("--family") + 1]
    r = run_dcr("gen", "-o", tmp_path / "run", "--family", family, "--size", "2MB", "--versions", "0")
    assert r.returncode == 0, r
    path, doc = generate(tmp_path, *args)
    assert doc["format"] == "dcr-layout" and doc["format_version"] == 1
    # Every copy's box lies inside its tensor (an independent check).
    shapes = {t["name"]: t["shape"] for t in doc["tensors"]}
    for c in doc["copies"]:
        for o, e, d in zip(c["offset"], c["extent"], shapes[c["tensor"]]):
            assert o + e <= d
    r = run_dcr("layout", "validate", path, "--checkpoint", tmp_path / "run" / "v0")
    assert r.returncode == 0, r
    assert "valid" in r.stdout
    r = run_dcr("layout", "show", path)
    assert r.returncode == 0, r
    assert f"{len(doc['copies'])} copies" in r.stdout


def test_broken_maps_name_the_entry(tmp_path):
    _, doc = generate(tmp_path, "--side", "vllm", "--family", "llama")
    cases = {
        "outside": lambda d: d["copies"][3]["offset"].__setitem__(0, 10**9),
        "two_writers": lambda d: d["copies"][1].update(buffer=d["copies"][0]["buffer"],
                                                        buffer_offset=d["copies"][0]["buffer_offset"]),
        "bad_dtype": lambda d: d["buffers"][0].update(dtype="NOPE"),
    }
    want = {"outside": "copy #3", "two_writers": "write the same elements", "bad_dtype": "buffers[0]"}
    for name, edit in cases.items():
        d = json.loads(json.dumps(doc))
        edit(d)
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        r = run_dcr("layout", "validate", p)
        assert_no_crash(r)
        assert r.returncode == 2, r
        assert want[name] in r.stderr, (name, r.stderr)
    r = run_dcr("layout", "validate", tmp_path / "missing.json")
    assert r.returncode == 2 and "cannot open" in r.stderr
    r = run_dcr("layout", "generate", "--side", "vllm", "--family", "llama", "--size", "2MB", "--tp", "3")
    assert r.returncode == 2 and "not divisible" in r.stderr
