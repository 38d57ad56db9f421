"""Malformed input: every case exits 2 with "dcr <cmd>: CODE: message" naming
the file (and the tensor where there is one), for inspect and for diff on
either side; never a crash, never a hang."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_no_crash, run_dcr, write_raw_safetensors

F32x4 = np.arange(4, dtype=np.float32).tobytes()


def entry(dtype="F32", shape=(4,), begin=0, end=16):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def raw(path: Path, header, data=b"", **kw) -> Path:
    return write_raw_safetensors(path, header, data, **kw)


# name -> (builder(dir) -> path, tensor name the message must mention or None)
def _empty(d):
    p = d / "empty.safetensors"
    p.write_bytes(b"")
    return p


def _five(d):
    p = d / "five.safetensors"
    p.write_bytes(b"\x08\x00\x00\x00\x00")
    return p


CASES = {
    "empty file": (_empty, None),
    "5-byte file": (_five, None),
    "header length past end": (lambda d: raw(d / "past.safetensors", {"t": entry()}, F32x4, header_len=4096), None),
    "header length > 100,000,000": (
        lambda d: raw(d / "huge.safetensors", {"t": entry()}, F32x4, header_len=100_000_001), None),
    "header length 2**64-1": (lambda d: raw(d / "max.safetensors", {"t": entry()}, F32x4, header_len=2**64 - 1),
                              None),
    "header length 0": (lambda d: raw(d / "zero.safetensors", b"", F32x4, header_len=0), None),
    "non-JSON header": (lambda d: raw(d / "nojson.safetensors", '{"t": {"dtype": "F32", "shape": [4], ', F32x4),
                        None),
    "text header": (lambda d: raw(d / "text.safetensors", "hello, world", F32x4), None),
    "invalid UTF-8 in header": (
        lambda d: raw(d / "utf8.safetensors",
                      b'{"t\xff\xfe": {"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', F32x4), None),
    "JSON array header": (lambda d: raw(d / "array.safetensors", [{"t": entry()}], F32x4), None),
    "JSON string header": (lambda d: raw(d / "string.safetensors", '"t"', F32x4), None),
    "duplicate tensor names": (
        lambda d: raw(d / "dup.safetensors",
                      '{"twice":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
                      '"twice":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}', F32x4 * 2), "twice"),
    "overlapping offsets": (
        lambda d: raw(d / "overlap.safetensors",
                      {"first": entry(begin=0, end=16), "second": entry(begin=8, end=24)}, F32x4 + F32x4[:8]),
        "second"),
    "same offsets": (
        lambda d: raw(d / "alias.safetensors",
                      {"one": entry(begin=0, end=16), "other": entry(begin=0, end=16)}, F32x4),
        ("one", "other")),
    "hole between tensors": (
        lambda d: raw(d / "hole.safetensors",
                      {"first": entry(begin=0, end=16), "after_hole": entry(begin=24, end=40)},
                      F32x4 + b"\0" * 8 + F32x4), "after_hole"),
    "hole at start": (lambda d: raw(d / "lead.safetensors", {"late": entry(begin=8, end=24)}, F32x4 + F32x4[:8]),
                      "late"),
    "bytes after last tensor": (lambda d: raw(d / "trail.safetensors", {"t": entry()}, F32x4 + b"\0" * 8), None),
    "byte count not matching shape": (
        lambda d: raw(d / "count.safetensors", {"short": entry(shape=(5,), begin=0, end=16)}, F32x4), "short"),
    "end before begin": (lambda d: raw(d / "backwards.safetensors", {"back": entry(begin=16, end=0)}, F32x4),
                         "back"),
    "unknown dtype F128": (lambda d: raw(d / "f128.safetensors", {"wide": entry(dtype="F128", end=64)}, F32x4 * 4),
                           "wide"),
    "lower-case dtype": (lambda d: raw(d / "lower.safetensors", {"lc": entry(dtype="f32")}, F32x4), "lc"),
    "negative shape": (lambda d: raw(d / "neg.safetensors", {"neg": entry(shape=(-1, 4))}, F32x4), "neg"),
    "fractional shape": (lambda d: raw(d / "frac.safetensors", {"frac": entry(shape=(2.5,))}, F32x4), "frac"),
    "string shape": (lambda d: raw(d / "strshape.safetensors", {"str": entry(shape=("4",))}, F32x4), "str"),
    "shape overflow": (
        lambda d: raw(d / "overflow.safetensors", {"vast": entry(shape=(2**40, 2**40, 2**40))}, F32x4), "vast"),
    "byte count overflow": (
        lambda d: raw(d / "bytes_overflow.safetensors", {"vast": entry(shape=(2**62,), end=2**64 - 1)}, F32x4),
        "vast"),
    "shape beyond 2**64": (lambda d: raw(d / "big.safetensors", {"vast": entry(shape=(2**70,))}, F32x4), "vast"),
    "sub-byte dtype with odd count": (
        lambda d: raw(d / "f4odd.safetensors", {"odd": entry(dtype="F4", shape=(3,), end=2)}, b"\0\0"), "odd"),
    "missing data_offsets": (
        lambda d: raw(d / "nooff.safetensors", {"nooff": {"dtype": "F32", "shape": [4]}}, F32x4), "nooff"),
    "entry not an object": (lambda d: raw(d / "notobj.safetensors", {"notobj": [1, 2]}, F32x4), "notobj"),
    "metadata not strings": (
        lambda d: raw(d / "meta.safetensors", {"__metadata__": {"k": 1}, "t": entry()}, F32x4), None),
    "truncated data": (lambda d: raw(d / "trunc.safetensors", {"a": entry(), "b": entry(begin=16, end=32)}, F32x4),
                       None),
    "huge offsets, tiny file": (
        lambda d: raw(d / "far.safetensors", {"far": entry(shape=(2**40,), begin=0, end=2**42)}, F32x4), None),
}


def _index_dir(d: Path, weight_map: dict, files: dict[str, dict]) -> Path:
    d.mkdir()
    for name, tensors in files.items():
        header, blob = {}, b""
        for t, data in tensors.items():
            header[t] = entry(shape=(len(data) // 4,), begin=len(blob), end=len(blob) + len(data))
            blob += data
        raw(d / name, header, blob)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return d


DIR_CASES = {
    "index names a tensor no file holds": (
        lambda d: _index_dir(d / "ghost", {"real": "model-00001-of-00001.safetensors",
                                           "ghost": "model-00001-of-00001.safetensors"},
                             {"model-00001-of-00001.safetensors": {"real": F32x4}}), "ghost"),
    "index names a missing file": (
        lambda d: _index_dir(d / "nofile", {"real": "model-00001-of-00002.safetensors",
                                            "lost": "model-00002-of-00002.safetensors"},
                             {"model-00001-of-00002.safetensors": {"real": F32x4}}), None),
    "file holds a tensor the index lacks": (
        lambda d: _index_dir(d / "unlisted", {"real": "m1.safetensors"},
                             {"m1.safetensors": {"real": F32x4, "stray": F32x4}}), "stray"),
    "index puts a tensor in the wrong file": (
        lambda d: _index_dir(d / "wrongfile", {"x": "m1.safetensors", "y": "m1.safetensors"},
                             {"m1.safetensors": {"x": F32x4}, "m2.safetensors": {"y": F32x4}}), "y"),
    "tensor stored in two shards": (
        lambda d: _index_dir(d / "twice", {"x": "m1.safetensors", "z": "m2.safetensors"},
                             {"m1.safetensors": {"x": F32x4}, "m2.safetensors": {"x": F32x4, "z": F32x4}}), "x"),
    "index is not JSON": (lambda d: _bad_index(d / "notjson", "{weight_map"), None),
    "index without weight_map": (lambda d: _bad_index(d / "nomap", json.dumps({"metadata": {}})), None),
    "index path escapes directory": (lambda d: _bad_index(d / "escape", json.dumps(
        {"weight_map": {"t": "../elsewhere.safetensors"}})), "t"),
    "shard in indexed dir is malformed": (
        lambda d: _index_dir(d / "badshard", {"t": "m1.safetensors"}, {"m1.safetensors": {"t": F32x4[:6]}}), None),
    "directory without safetensors": (lambda d: _mkdir(d / "nothing"), None),
}


def _bad_index(d: Path, text: str) -> Path:
    d.mkdir()
    raw(d / "model.safetensors", {"t": entry()}, F32x4)
    (d / "model.safetensors.index.json").write_text(text)
    return d


def _mkdir(d: Path) -> Path:
    d.mkdir()
    (d / "README.txt").write_text("no weights here")
    return d


ALL = {**CASES, **DIR_CASES}


@pytest.fixture
def good(tmp) -> Path:
    return raw(tmp / "good.safetensors", {"t": entry()}, F32x4)


def check_error(r, cmd: str, path: Path, tensor: str | tuple[str, ...] | None) -> None:
    assert_no_crash(r)
    assert r.returncode == 2, str(r)
    assert r.stdout.strip() == "", f"nothing belongs on stdout on error: {r}"
    err = r.stderr.strip()
    assert err.startswith(f"dcr {cmd}: "), str(r)
    code = err[len(f"dcr {cmd}: "):].split(":")[0]
    assert code and code.replace("_", "").isalpha() and code.upper() == code, f"no error code in: {err}"
    assert str(path) in err or path.name in err, f"message does not name {path}: {err}"
    if tensor is not None:
        names = (tensor,) if isinstance(tensor, str) else tensor
        assert any(f"'{t}'" in err for t in names), f"message does not name tensor {tensor}: {err}"
    assert len(err.splitlines()) <= 3, f"one short message, not a dump: {err}"


@pytest.mark.parametrize("case", list(ALL))
def test_inspect_rejects(tmp, case):
    builder, tensor = ALL[case]
    path = builder(tmp)
    for extra in ([], ["--json"], ["--json", "--checksums"]):
        r = run_dcr("inspect", path, *extra)
        check_error(r, "inspect", path, tensor)


@pytest.mark.parametrize("case", list(ALL))
def test_diff_rejects_either_side(tmp, good, case):
    builder, tensor = ALL[case]
    path = builder(tmp)
    check_error(run_dcr("diff", path, good, "--json"), "diff", path, tensor)
    check_error(run_dcr("diff", good, path), "diff", path, tensor)
    check_error(run_dcr("diff", path, path, "--summary"), "diff", path, tensor)


def test_file_cases_are_valid_once_fixed(tmp):
    """Guard against false passes: the 'good' variant of the helper is accepted."""
    p = raw(tmp / "fine.safetensors", {"a": entry(), "b": entry(begin=16, end=32)}, F32x4 * 2)
    r = run_dcr("inspect", p, "--json")
    assert r.returncode == 0, str(r)
    assert [t["name"] for t in r.json()["tensors"]] == ["a", "b"]
    d = _index_dir(tmp / "okdir", {"x": "m1.safetensors", "y": "m2.safetensors"},
                   {"m1.safetensors": {"x": F32x4}, "m2.safetensors": {"y": F32x4}})
    r = run_dcr("inspect", d, "--json")
    assert r.returncode == 0, str(r)
    assert r.json()["total_tensors"] == 2


def test_nonexistent_path(tmp, good):
    missing = tmp / "no" / "such.safetensors"
    check_error(run_dcr("inspect", missing), "inspect", missing, None)
    check_error(run_dcr("diff", missing, good), "diff", missing, None)
    check_error(run_dcr("diff", good, missing, "--json"), "diff", missing, None)


def test_symlink_loop(tmp, good):
    loop = tmp / "loop.safetensors"
    loop.symlink_to(loop)
    check_error(run_dcr("inspect", loop), "inspect", loop, None)
    check_error(run_dcr("diff", good, loop), "diff", loop, None)


def test_fifo_is_rejected_not_waited_on(tmp):
    fifo = tmp / "pipe.safetensors"
    os.mkfifo(fifo)
    try:
        check_error(run_dcr("inspect", fifo, timeout=3), "inspect", fifo, None)
    finally:  # release a reader still blocked in open(), should one outlive the timeout
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_random_garbage_never_crashes(tmp, good):
    """Mutated headers of a valid file: any outcome but a crash is fine; errors exit 2."""
    rng = np.random.default_rng(7)
    base = bytearray(good.read_bytes())
    (n,) = struct.unpack("<Q", base[:8])
    for i in range(60):
        b = bytearray(base)
        for _ in range(rng.integers(1, 4)):
            pos = int(rng.integers(0, 8 + n))
            b[pos] = int(rng.integers(0, 256))
        p = tmp / f"m{i}.safetensors"
        p.write_bytes(bytes(b))
        r = run_dcr("inspect", p, "--json", "--checksums")
        assert_no_crash(r)
        assert r.returncode in (0, 2), str(r)
        if r.returncode == 2:
            assert r.stderr.startswith("dcr inspect: ") and p.name in r.stderr, str(r)


# ------------------------------------------------------------- CLI misuse

MISUSE = [
    [],
    ["--bogus"],
    ["frobnicate"],
    ["inspect"],
    ["inspect", "--bogus", "x"],
    ["diff"],
    ["diff", "only-one"],
    ["diff", "a", "b", "c"],
    ["diff", "a", "b", "--bogus"],
    ["gen"],                                       # -o is required
    ["gen", "-o"],
    ["gen", "-o", "{tmp}/g", "--family", "gpt5"],
    ["gen", "-o", "{tmp}/g", "--update", "chaos"],
    ["gen", "-o", "{tmp}/g", "--size", "lots"],
    ["gen", "-o", "{tmp}/g", "--size", "-5MB"],
    ["gen", "-o", "{tmp}/g", "--rate", "0"],
    ["gen", "-o", "{tmp}/g", "--rate", "1.5"],
    ["gen", "-o", "{tmp}/g", "--rate", "abc"],
    ["gen", "-o", "{tmp}/g", "--versions", "-1"],
    ["gen", "-o", "{tmp}/g", "--shard-size", "3 parsecs"],
]


@pytest.mark.parametrize("argv", MISUSE, ids=lambda a: " ".join(a) or "<none>")
def test_cli_misuse_exits_2(tmp, argv):
    r = run_dcr(*[a.format(tmp=tmp) for a in argv])
    assert_no_crash(r)
    assert r.returncode == 2, str(r)
    assert (r.stderr + r.stdout).strip(), "misuse must say what is wrong"


def test_help_and_version_exit_0(dcr_bin):
    for argv in (["--help"], ["inspect", "--help"], ["diff", "--help"], ["gen", "--help"], ["--version"]):
        r = run_dcr(*argv)
        assert r.returncode == 0, str(r)
        assert r.stdout.strip()


def test_gen_into_a_file_path_fails_cleanly(tmp):
    blocker = tmp / "file"
    blocker.write_text("x")
    r = run_dcr("gen", "-o", blocker, "--size", "1MB", "--versions", "1")
    assert_no_crash(r)
    assert r.returncode == 2, str(r)
    assert r.stderr.startswith("dcr gen: ") and str(blocker) in r.stderr, str(r)
