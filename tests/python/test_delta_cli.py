"""`dcr delta make | apply | verify | inspect` end to end: a delta applied to a
copy of its base gives the next version byte for byte (checked with filecmp
and with `dcr diff`), in every model family and update model, in both delta
classes; wrong bases, repeated applies and corrupt deltas are handled without
damaging the target."""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path

import pytest
from conftest import assert_no_crash, dcr_json, dcr_ok, run_dcr

FAMILIES = ["llama", "qwen3-moe", "deepseek-v3"]
UPDATES = ["training", "stress"]
# Small chunks so that a 2 MB model has many frames.
CHUNK = "4096"


# ------------------------------------------------------------------- helpers

def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_tree(a: Path, b: Path) -> None:
    """a and b hold the same files with the same bytes (filecmp, not shallow)."""
    names_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    names_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert names_a == names_b
    match, mismatch, errors = filecmp.cmpfiles(a, b, names_a, shallow=False)
    assert mismatch == [] and errors == [], f"differ: {mismatch}, errors: {errors}"
    assert sorted(match) == names_a


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def make(base: Path, new: Path, out: Path, *extra) -> dict:
    return dcr_json("delta", "make", base, new, "-o", out, "--chunk", CHUNK, "--json", *extra)


def apply(target: Path, delta: Path) -> dict:
    return dcr_json("delta", "apply", target, delta, "--json")


def diff(a: Path, b: Path) -> tuple[int, dict]:
    r = run_dcr("diff", a, b, "--json")
    assert r.returncode in (0, 1), str(r)
    return r.returncode, r.json()


def manifest(delta: Path) -> dict:
    """The delta's whole manifest as JSON (the table and every frame entry)."""
    return dcr_json("delta", "inspect", delta, "--manifest")


def inspect(delta: Path) -> dict:
    return dcr_json("delta", "inspect", delta, "--frames", "--json")


@pytest.fixture
def versions(gen_cache):
    """(dir, gen report) of a generated model with v0..v2."""
    def get(family: str = "qwen3-moe", update: str = "training") -> tuple[Path, dict]:
        return gen_cache.get(family, update=update, size="2MB", versions=2)
    return get


# ------------------------------------------------------------ make and apply

@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("family", FAMILIES)
def test_apply_gives_next_version(tmp, versions, family, update):
    g, report = versions(family, update)
    v0, v1 = g / "v0", g / "v1"
    d = tmp / "d01"
    made = make(v0, v1, d)

    # The JSON report of make.
    for key in ("payload_bytes", "changed_elements", "total_elements", "frames", "seconds"):
        assert key in made, f"missing {key}: {made}"
    assert isinstance(made["seconds"], float) and made["seconds"] >= 0
    assert made["total_elements"] == report["elements_per_version"]
    assert made["frames"] > 10, "chunks of 4096 elements: a 2 MB model changes in many chunks"
    assert 0 < made["changed_elements"] < made["total_elements"]
    assert 0 < made["payload_bytes"] < made["total_bytes"]
    # Each frame: a header of 27 to 43 bytes (docs/format.md), then its payload.
    headers = made["frame_bytes"] - made["payload_bytes"]
    assert 27 * made["frames"] <= headers <= 43 * made["frames"], made
    m = manifest(d)
    assert len(m["frames"]) == made["frames"]
    assert (d / "frames.bin").stat().st_size == made["frame_bytes"]
    # What a receiver downloads per version: the manifest and the frames; the
    # tensor table once per run.
    assert made["manifest_bytes"] == (d / "manifest.bin").stat().st_size
    assert made["table_bytes"] == (d / "tensors.json").stat().st_size
    assert made["download_bytes"] == sum(f.stat().st_size for f in d.iterdir() if f.is_file()) - made["table_bytes"]
    assert made["download_bytes"] == made["frame_bytes"] + made["manifest_bytes"]
    # Sized by the change: a few bytes per frame besides the fixed part.
    assert made["manifest_bytes"] < 64 + 8 * made["frames"]
    assert made["download_bytes_per_changed_word"] == pytest.approx(
        made["download_bytes"] / made["changed_words"])

    # Applied to a copy of v0: v1, byte for byte, by filecmp and by dcr diff.
    t = copy_ckpt(v0, tmp / "t")
    applied = apply(t, d)
    assert applied["frames_applied"] == made["frames"]
    assert applied["frames_already_applied"] == 0
    assert applied["payload_bytes"] == made["payload_bytes"]
    assert applied["changed_words"] == made["changed_words"]
    assert_same_tree(t, v1)
    rc, doc = diff(t, v1)
    assert rc == 0 and doc["identical"] is True and doc["changed_elements"] == 0

    # The delta counts exactly the elements dcr diff finds changed (BF16 and
    # F32 words are elements).
    rc, doc = diff(v0, v1)
    assert rc == 1
    assert made["changed_elements"] == doc["changed_elements"]
    assert made["changed_elements"] == report["changed_per_version"][0]

    # verify: exit 0 for the target, 1 for anything else, --base flips it.
    dcr_ok("delta", "verify", t, d)
    dcr_ok("delta", "verify", v1, d)
    dcr_ok("delta", "verify", v0, d, expect=1)
    dcr_ok("delta", "verify", v0, d, "--base")
    dcr_ok("delta", "verify", v1, d, "--base", expect=1)
    dcr_ok("delta", "verify", g / "v2", d, expect=1)


def test_changed_elements_match_diff_for_bf16_models(tmp, versions):
    for family in ("llama", "qwen3-moe"):
        for update in UPDATES:
            g, _ = versions(family, update)
            made = make(g / "v1", g / "v2", tmp / f"d-{family}-{update}")
            _, doc = diff(g / "v1", g / "v2")
            assert made["changed_elements"] == doc["changed_elements"], (family, update)
            # ... and per tensor, in the manifest's frames.
            m = manifest(tmp / f"d-{family}-{update}")
            per_tensor: dict[str, int] = {}
            for f in m["frames"]:
                name = m["tensors"][f["tensor"]]["name"]
                per_tensor[name] = per_tensor.get(name, 0) + f["changed"]
            expected = {t["name"]: t["changed_elements"] for t in doc["tensors"] if t["changed_elements"]}
            assert per_tensor == expected, (family, update)


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_deltas(tmp, versions, family):
    g, _ = versions(family, "training")
    make(g / "v0", g / "v1", tmp / "d01")
    make(g / "v1", g / "v2", tmp / "d12")
    t = copy_ckpt(g / "v0", tmp / "t")
    apply(t, tmp / "d01")
    assert_same_tree(t, g / "v1")
    apply(t, tmp / "d12")
    assert_same_tree(t, g / "v2")
    assert diff(t, g / "v2")[0] == 0
    # Out of order: the second delta on v0 is refused.
    t2 = copy_ckpt(g / "v0", tmp / "t2")
    r = run_dcr("delta", "apply", t2, tmp / "d12")
    assert r.returncode == 2, str(r)
    assert_same_tree(t2, g / "v0")


@pytest.mark.parametrize("family", FAMILIES)
def test_overwrite_mode(tmp, versions, family):
    g, _ = versions(family, "stress")
    d = tmp / "d"
    made = make(g / "v0", g / "v1", d, "--mode", "overwrite")
    assert made["mode"] == "overwrite"
    info = inspect(d)
    assert info["class"] == "overwrite"
    assert info["frames"] == made["frames"] == len(info["frame_list"])
    assert {f["mode"] for f in info["frame_list"]} == {"overwrite"}
    t = copy_ckpt(g / "v0", tmp / "t")
    applied = apply(t, d)
    assert applied["frames_applied"] == made["frames"]
    assert_same_tree(t, g / "v1")
    # Overwrite frames carry the new bits: applying again changes nothing.
    again = apply(t, d)
    assert again["frames_applied"] == 0 and again["frames_already_applied"] == made["frames"]
    assert_same_tree(t, g / "v1")
    # Overwrite payloads carry values, xor-class ones differences: never smaller.
    xor = make(g / "v0", g / "v1", tmp / "dx")
    assert made["changed_elements"] == xor["changed_elements"]
    assert made["payload_bytes"] >= xor["payload_bytes"]


def test_no_add_uses_only_xor_frames(tmp, versions):
    g, _ = versions("qwen3-moe", "training")
    made = make(g / "v0", g / "v1", tmp / "d", "--no-add")
    info = inspect(tmp / "d")
    assert {f["mode"] for f in info["frame_list"]} == {"xor"}
    with_add = make(g / "v0", g / "v1", tmp / "d2")
    modes = {f["mode"] for f in inspect(tmp / "d2")["frame_list"]}
    assert "add" in modes, "BF16 training steps are small: add frames should win somewhere"
    assert with_add["payload_bytes"] <= made["payload_bytes"]
    t = copy_ckpt(g / "v0", tmp / "t")
    apply(t, tmp / "d")
    assert_same_tree(t, g / "v1")


# ------------------------------------------------------- refusals and repeats

def test_apply_refuses_wrong_base(tmp, versions):
    g, _ = versions("llama", "training")
    d = tmp / "d12"
    make(g / "v1", g / "v2", d)
    t = copy_ckpt(g / "v0", tmp / "t")
    before = snapshot(t)
    r = run_dcr("delta", "apply", t, d)
    assert r.returncode == 2, str(r)
    assert "tensor '" in r.stderr, r.stderr
    assert "not the base" in r.stderr, r.stderr
    names = {t["name"] for t in manifest(d)["tensors"]}
    assert any(f"'{n}'" in r.stderr for n in names), r.stderr
    assert snapshot(t) == before, "a refused apply changed the target"
    # The target itself: v2 is not v1 either.
    t2 = copy_ckpt(g / "v2", tmp / "t2")
    r = run_dcr("delta", "apply", t2, d)
    assert r.returncode == 0, "v2 is the delta's target: every frame is already applied"
    assert_same_tree(t2, g / "v2")


def test_apply_refuses_wrong_base_overwrite_class(tmp, versions):
    # An overwrite delta whose sparse frames cannot repair other bits must
    # refuse too, before writing.
    g, _ = versions("llama", "training")
    d = tmp / "d12"
    make(g / "v1", g / "v2", d, "--mode", "overwrite")
    t = copy_ckpt(g / "v0", tmp / "t")
    before = snapshot(t)
    r = run_dcr("delta", "apply", t, d)
    assert_no_crash(r)
    if r.returncode == 0:
        assert_same_tree(t, g / "v2")  # only acceptable if it really produced the target
    else:
        assert r.returncode == 2, str(r)
        assert "tensor '" in r.stderr and "not the base" in r.stderr, r.stderr
        assert snapshot(t) == before, "a refused apply changed the target"


def test_apply_twice_is_harmless(tmp, versions):
    g, _ = versions("deepseek-v3", "training")
    d = tmp / "d"
    made = make(g / "v0", g / "v1", d)
    t = copy_ckpt(g / "v0", tmp / "t")
    apply(t, d)
    again = apply(t, d)
    assert again["frames_applied"] == 0
    assert again["frames_already_applied"] == made["frames"]
    assert again["changed_words"] == 0 and again["payload_bytes"] == 0
    assert_same_tree(t, g / "v1")
    # The text report says so.
    r = dcr_ok("delta", "apply", t, d)
    assert f"{made['frames']} frames were already applied" in r.stdout, r.stdout
    assert_same_tree(t, g / "v1")


def test_verify_exit_codes(tmp, versions):
    g, _ = versions("qwen3-moe", "stress")
    d = tmp / "d"
    make(g / "v0", g / "v1", d)
    doc = dcr_json("delta", "verify", g / "v1", d, "--json")
    assert doc["matches"] is True and doc["differing"] == [] and doc["against"] == "target"
    doc = dcr_json("delta", "verify", g / "v0", d, "--json", expect=1)
    assert doc["matches"] is False and doc["differing"]
    changed = {t["name"] for t in diff(g / "v0", g / "v1")[1]["tensors"] if t["changed_elements"]}
    assert set(doc["differing"]) == changed
    doc = dcr_json("delta", "verify", g / "v0", d, "--base", "--json")
    assert doc["matches"] is True and doc["against"] == "base"
    r = dcr_ok("delta", "verify", g / "v0", d, expect=1)
    assert "is NOT" in r.stdout
    # Errors: exit 2.
    other, _ = versions("llama", "training")
    r = run_dcr("delta", "verify", other / "v0", d)
    assert r.returncode == 2, str(r)
    r = run_dcr("delta", "verify", g / "v1", tmp / "nowhere")
    assert r.returncode == 2, str(r)


def test_inspect_lists_frames(tmp, versions):
    g, _ = versions("deepseek-v3", "stress")
    d = tmp / "d"
    made = make(g / "v0", g / "v1", d)
    info = inspect(d)
    m = manifest(d)
    assert info["frames"] == made["frames"] == len(info["frame_list"]) == len(m["frames"])
    assert info["changed_words"] == made["changed_words"]
    assert info["payload_bytes"] == made["payload_bytes"]
    assert info["delta_id"] == made["delta_id"] == m["delta_id"]
    assert info["base_digest"] == made["base_digest"] and info["target_digest"] == made["target_digest"]
    assert sum(v["frames"] for v in info["by_mode_and_codec"].values()) == made["frames"]
    assert sum(v["payload_bytes"] for v in info["by_mode_and_codec"].values()) == made["payload_bytes"]
    names = [t["name"] for t in m["tensors"]]
    for f, e in zip(info["frame_list"], m["frames"]):
        assert f["tensor"] == names[e["tensor"]] and f["chunk"] == e["chunk"] and f["changed"] == e["changed"]
    # Text: one line per frame, naming tensor and chunk.
    r = dcr_ok("delta", "inspect", d, "--frames")
    lines = [line for line in r.stdout.splitlines() if " chunk " in line and " changed, " in line]
    assert len(lines) == made["frames"]
    assert f"all {made['frames']} frames verified" in r.stdout


def test_make_refuses_existing_delta_and_mismatched_models(tmp, versions):
    g, _ = versions("qwen3-moe", "training")
    make(g / "v0", g / "v1", tmp / "d")
    before = snapshot(tmp / "d")
    r = run_dcr("delta", "make", g / "v1", g / "v2", "-o", tmp / "d")
    assert r.returncode == 2 and "already holds a delta" in r.stderr, str(r)
    assert snapshot(tmp / "d") == before
    other, _ = versions("llama", "training")
    r = run_dcr("delta", "make", g / "v0", other / "v1", "-o", tmp / "d2")
    assert r.returncode == 2 and "tensor '" in r.stderr, str(r)
    assert not (tmp / "d2" / "manifest.json").exists()
    for bad in ("0", "7", "abc"):
        r = run_dcr("delta", "make", g / "v0", g / "v1", "-o", tmp / f"d-{bad}", "--chunk", bad)
        assert r.returncode == 2, str(r)
    r = run_dcr("delta", "make", g / "v0", g / "v1", "-o", tmp / "d3", "--mode", "add")
    assert r.returncode == 2 and "--mode" in r.stderr, str(r)


# ------------------------------------------------------------- corrupt deltas

def test_corrupt_frame_is_refused_without_writing(tmp, versions):
    g, _ = versions("qwen3-moe", "training")
    d = tmp / "d"
    make(g / "v0", g / "v1", d)
    m = manifest(d)
    k = len(m["frames"]) // 2
    f = m["frames"][k]
    tensor = m["tensors"][f["tensor"]]["name"]
    blob = bytearray((d / "frames.bin").read_bytes())
    blob[f["offset"] + 96 + (f["bytes"] - 96) // 2] ^= 0x04  # inside the payload
    (d / "frames.bin").write_bytes(bytes(blob))

    t = copy_ckpt(g / "v0", tmp / "t")
    before = snapshot(t)
    r = run_dcr("delta", "apply", t, d)
    assert r.returncode == 2, str(r)
    assert f"'{tensor}'" in r.stderr and f"chunk {f['chunk']}" in r.stderr, r.stderr
    assert "checksum" in r.stderr, r.stderr
    assert snapshot(t) == before, "a corrupt delta changed the target"
    # inspect and verify-free checks see it too.
    r = run_dcr("delta", "inspect", d)
    assert r.returncode == 2 and f"'{tensor}'" in r.stderr, str(r)


def test_altered_manifest_digest_is_refused_without_writing(tmp, versions):
    """Frames carry their chunks' digests, so only the manifest says what the
    whole checkpoint must end as. One whose target digest was altered (its
    checksum made good: re-encoded) is refused before the target is touched."""
    import dcr
    g, _ = versions("qwen3-moe", "training")
    d = tmp / "d"
    make(g / "v0", g / "v1", d)
    original = (d / "manifest.bin").read_bytes()
    t = copy_ckpt(g / "v0", tmp / "t")
    before = snapshot(t)

    delta = dcr.read_delta(d)
    m = json.loads(delta.manifest_json)
    m["target_digest"] = m["base_digest"]
    altered = tmp / "altered"
    dcr.Delta.from_parts(json.dumps(m), delta.frames).write(altered)
    (d / "manifest.bin").write_bytes((altered / "manifest.bin").read_bytes())
    assert (d / "manifest.bin").read_bytes() != original
    r = run_dcr("delta", "apply", t, d)
    assert r.returncode == 2, str(r)
    assert "not the base" in r.stderr and "nothing was written" in r.stderr, r.stderr
    assert snapshot(t) == before, "an altered manifest changed the target"

    # The untouched manifest still applies, and says it verified the result.
    (d / "manifest.bin").write_bytes(original)
    applied = apply(t, d)
    assert applied["verified"] is True and applied["frames_applied"] == len(manifest(d)["frames"])
    assert_same_tree(t, g / "v1")


def test_truncated_frames_bin(tmp, versions):
    g, _ = versions("llama", "stress")
    d = tmp / "d"
    make(g / "v0", g / "v1", d)
    data = (d / "frames.bin").read_bytes()
    (d / "frames.bin").write_bytes(data[:-10])
    t = copy_ckpt(g / "v0", tmp / "t")
    before = snapshot(t)
    r = run_dcr("delta", "apply", t, d)
    assert r.returncode == 2, str(r)
    assert "frames.bin" in r.stderr, r.stderr
    assert snapshot(t) == before


def test_missing_or_broken_delta_directory(tmp, versions):
    g, _ = versions("llama", "training")
    t = copy_ckpt(g / "v0", tmp / "t")
    before = snapshot(t)
    # No such directory.
    r = run_dcr("delta", "apply", t, tmp / "no-such-delta")
    assert r.returncode == 2, str(r)
    assert "no-such-delta" in r.stderr and "manifest.bin" in r.stderr, r.stderr
    # A directory without a manifest.
    (tmp / "empty").mkdir()
    r = run_dcr("delta", "apply", t, tmp / "empty")
    assert r.returncode == 2 and "not a delta" in r.stderr, str(r)
    # A truncated manifest.
    d = tmp / "d"
    make(g / "v0", g / "v1", d)
    data = (d / "manifest.bin").read_bytes()
    (d / "manifest.bin").write_bytes(data[: len(data) // 2])
    for cmd in (["apply", t, d], ["verify", t, d], ["inspect", d]):
        r = run_dcr("delta", *cmd)
        assert_no_crash(r)
        assert r.returncode == 2, str(r)
        assert "manifest.bin" in r.stderr and "checksum" in r.stderr, r.stderr
    # A delta of format version 1 (a JSON manifest.json): refused, naming the version.
    (d / "manifest.bin").unlink()
    (d / "manifest.json").write_text(json.dumps({"format": "dcr-delta", "format_version": 1}))
    r = run_dcr("delta", "apply", t, d)
    assert r.returncode == 2 and "format version 1" in r.stderr, str(r)
    # frames.bin missing.
    d2 = tmp / "d2"
    make(g / "v0", g / "v1", d2)
    (d2 / "frames.bin").unlink()
    r = run_dcr("delta", "apply", t, d2)
    assert r.returncode == 2 and "frames.bin" in r.stderr, str(r)
    assert snapshot(t) == before
