"""`dcr diff` against an independent bit-level comparison.

Two references: a vectorised numpy one (used on generated checkpoints) and a
hand-computed table of planted changes (+0/-0, NaN payloads, infinities,
subnormals, integer extremes) in every dtype, written with torch/numpy or, for
the packed sub-byte types, byte by byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from conftest import RawTensor, read_checkpoint, run_dcr, write_raw_safetensors

import torch  # noqa: E402
import safetensors.torch  # noqa: E402


# name -> (bits, kind, sign bits, exponent bits, mantissa bits); kinds: f float, c complex, s signed, u unsigned
DTYPES = {
    "BOOL": (8, "u", 0, 0, 0), "U8": (8, "u", 0, 0, 0), "I8": (8, "s", 0, 0, 0),
    "I16": (16, "s", 0, 0, 0), "U16": (16, "u", 0, 0, 0), "I32": (32, "s", 0, 0, 0),
    "U32": (32, "u", 0, 0, 0), "I64": (64, "s", 0, 0, 0), "U64": (64, "u", 0, 0, 0),
    "F16": (16, "f", 1, 5, 10), "BF16": (16, "f", 1, 8, 7), "F32": (32, "f", 1, 8, 23),
    "F64": (64, "f", 1, 11, 52), "C64": (64, "c", 1, 8, 23),
    "F8_E4M3": (8, "f", 1, 4, 3), "F8_E5M2": (8, "f", 1, 5, 2), "F8_E8M0": (8, "f", 0, 8, 0),
    "F8_E4M3FNUZ": (8, "f", 1, 4, 3), "F8_E5M2FNUZ": (8, "f", 1, 5, 2),
    "F4": (4, "f", 1, 2, 1), "F6_E2M3": (6, "f", 1, 2, 3), "F6_E3M2": (6, "f", 1, 3, 2),
}
FLOATY = {k for k, v in DTYPES.items() if v[1] in "fc"}
U64 = np.uint64


# ----------------------------------------------------------- numpy reference

def unpack(dtype: str, data: bytes) -> np.ndarray:
    """Element bit patterns as uint64 (C64: shape [n, 2], one row per element)."""
    bits = DTYPES[dtype][0]
    raw = np.frombuffer(data, dtype=np.uint8)
    if bits < 8:
        b = np.unpackbits(raw, bitorder="little").reshape(-1, bits).astype(U64)
        return (b << np.arange(bits, dtype=U64)).sum(axis=1, dtype=U64)
    if dtype == "C64":
        return raw.view("<u4").astype(U64).reshape(-1, 2)
    return raw.view(f"<u{bits // 8}").astype(U64)


def ordered(v: np.ndarray, width: int, kind: str, sign_bits: int) -> np.ndarray:
    mask = U64((1 << width) - 1)
    sb = U64(1 << (width - 1))
    if kind in "fc" and sign_bits:
        return np.where(v & sb, ~v & mask, v | sb)
    if kind == "s":
        return v ^ sb
    return v


def ref_stats(dtype: str, a: bytes, b: bytes) -> dict:
    bits, kind, sb_bits, eb, mb = DTYPES[dtype]
    va, vb = unpack(dtype, a), unpack(dtype, b)
    width = 32 if dtype == "C64" else bits
    x = va ^ vb
    sm = U64((1 << (width - 1)) if sb_bits else 0)
    em = U64(((1 << eb) - 1) << mb)
    mm = U64((1 << mb) - 1)

    def count(mask):
        hit = (x & mask) != 0
        return int((hit.any(axis=1) if hit.ndim == 2 else hit).sum())

    ia, ib = ordered(va, width, kind, sb_bits), ordered(vb, width, kind, sb_bits)
    d = np.where(ia > ib, ia - ib, ib - ia)
    out = {"elements": int(va.shape[0]), "changed": count(U64((1 << width) - 1)),
           "max_ulp": int(d.max()) if d.size else 0}
    if kind in "fc":
        out.update(sign=count(sm), exponent=count(em), mantissa=count(mm))
    else:
        out.update(sign=0, exponent=0, mantissa=0)
    return out


def elements_of(t: RawTensor) -> int:
    return math.prod(t.shape)


def check_diff(doc: dict, a: dict[str, RawTensor], b: dict[str, RawTensor]) -> dict:
    """Checks a `dcr diff --json` document against the numpy reference; returns the totals."""
    both = sorted(set(a) & set(b))
    same = [k for k in both if (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape)]
    assert sorted(doc["only_in_a"]) == sorted(set(a) - set(b))
    assert sorted(doc["only_in_b"]) == sorted(set(b) - set(a))
    mism = sorted(set(both) - set(same))
    assert sorted(m.split(":")[0] for m in doc["mismatched"]) == mism, doc["mismatched"]
    got = {t["name"]: t for t in doc["tensors"]}
    assert sorted(got) == same
    total = {"elements": 0, "changed": 0, "sign": 0, "exponent": 0, "mantissa": 0, "max_ulp": 0}
    for k in same:
        r = ref_stats(a[k].dtype, a[k].data, b[k].data)
        assert r["elements"] == elements_of(a[k])
        t = got[k]
        assert t["dtype"] == a[k].dtype
        assert t["elements"] == r["elements"], k
        assert t["changed_elements"] == r["changed"], k
        assert t["max_ulp"] == r["max_ulp"], k
        pct = 100.0 * r["changed"] / r["elements"] if r["elements"] else 0.0
        assert t["changed_percent"] == pytest.approx(pct, rel=1e-9, abs=1e-12), k
        if a[k].dtype in FLOATY:
            assert (t["sign_changed"], t["exponent_changed"], t["mantissa_changed"]) == (
                r["sign"], r["exponent"], r["mantissa"]), k
        else:
            assert all(t.get(f, 0) == 0 for f in ("sign_changed", "exponent_changed", "mantissa_changed")), k
        for f in ("elements", "changed", "sign", "exponent", "mantissa"):
            total[f] += r[f]
        total["max_ulp"] = max(total["max_ulp"], r["max_ulp"])
    assert doc["total_elements"] == total["elements"]
    assert doc["changed_elements"] == total["changed"]
    assert doc["sign_changed"] == total["sign"]
    assert doc["exponent_changed"] == total["exponent"]
    assert doc["mantissa_changed"] == total["mantissa"]
    assert doc["max_ulp"] == total["max_ulp"]
    pct = 100.0 * total["changed"] / total["elements"] if total["elements"] else 0.0
    assert doc["changed_percent"] == pytest.approx(pct, rel=1e-9, abs=1e-12)
    identical = total["changed"] == 0 and not doc["only_in_a"] and not doc["only_in_b"] and not mism
    assert doc["identical"] is identical
    return total


def diff(a, b, *extra) -> tuple[int, dict]:
    r = run_dcr("diff", a, b, "--json", *extra)
    assert r.returncode in (0, 1), str(r)
    doc = r.json()
    assert r.returncode == (0 if doc["identical"] else 1), str(r)
    return r.returncode, doc


# ------------------------------------------------------ generated checkpoints

GEN_PAIRS = [
    ("llama", "training", 0.03, None),
    ("qwen3-moe", "stress", 0.05, None),
    ("deepseek-v3", "training", 0.03, None),
    ("deepseek-v3", "stress", 0.03, "300KB"),
]


@pytest.mark.parametrize("family,update,rate,shard", GEN_PAIRS)
def test_diff_matches_numpy_on_generated(gen_cache, family, update, rate, shard):
    out, _ = gen_cache.get(family, update=update, rate=rate, shard_size=shard)
    versions = [read_checkpoint(out / f"v{i}") for i in range(3)]
    for i in range(2):
        rc, doc = diff(out / f"v{i}", out / f"v{i + 1}")
        assert rc == 1
        total = check_diff(doc, versions[i], versions[i + 1])
        assert total["changed"] > 0 and doc["identical"] is False
        # --summary: same totals, no per-tensor list.
        rc2, summary = diff(out / f"v{i}", out / f"v{i + 1}", "--summary")
        assert rc2 == 1 and "tensors" not in summary
        for k in ("total_elements", "changed_elements", "sign_changed", "exponent_changed",
                  "mantissa_changed", "max_ulp", "identical"):
            assert summary[k] == doc[k], k
    # Skipping a version: v0 -> v2 also agrees.
    _, doc = diff(out / "v0", out / "v2")
    check_diff(doc, versions[0], versions[2])


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_identical_checkpoints_exit_0(gen_cache, family):
    out, _ = gen_cache.get(family)
    rc, doc = diff(out / "v1", out / "v1")
    assert rc == 0 and doc["identical"] is True
    assert doc["changed_elements"] == 0 and doc["max_ulp"] == 0
    assert doc["total_elements"] == sum(elements_of(t) for t in read_checkpoint(out / "v1").values())
    assert all(t["changed_elements"] == 0 and t["max_ulp"] == 0 for t in doc["tensors"])
    # Text mode keeps the exit codes.
    assert run_dcr("diff", out / "v1", out / "v1").returncode == 0
    assert run_dcr("diff", out / "v0", out / "v1").returncode == 1
    assert run_dcr("diff", out / "v0", out / "v1", "--summary").returncode == 1


def test_same_seed_single_file_vs_sharded_is_identical(gen_cache):
    single, _ = gen_cache.get("deepseek-v3", update="stress", shard_size=None)
    sharded, _ = gen_cache.get("deepseek-v3", update="stress", shard_size="300KB")
    for v in ("v0", "v2"):
        rc, doc = diff(single / v, sharded / v)
        assert rc == 0, doc
    # ... and a single .safetensors file path vs a sharded directory.
    rc, doc = diff(single / "v1" / "model.safetensors", sharded / "v1")
    assert rc == 0 and doc["total_elements"] > 0


# ------------------------------------------------------------ planted changes

@dataclass
class Plant:
    old: int | tuple[int, int]
    new: int | tuple[int, int]
    sign: int = 0
    exponent: int = 0
    mantissa: int = 0
    ulp: int = 0


P = Plant
# Hand-computed expectations: (old bits, new bits, sign, exponent, mantissa changed, ulp distance).
PLANTS: dict[str, list[Plant]] = {
    "BF16": [
        P(0x0000, 0x8000, 1, 0, 0, 1),            # +0 -> -0
        P(0x7FC0, 0x7FC1, 0, 0, 1, 1),            # NaN payload
        P(0x7F80, 0xFF80, 1, 0, 0, 0xFF01),       # inf -> -inf
        P(0x0001, 0x0002, 0, 0, 1, 1),            # subnormal -> subnormal
        P(0x0001, 0x8001, 1, 0, 0, 3),            # +min subnormal -> -min subnormal
        P(0x3F80, 0x4000, 0, 1, 0, 128),          # 1.0 -> 2.0
        P(0x7F80, 0x7FC0, 0, 0, 1, 64),           # inf -> NaN
        P(0xFFC0, 0x7FC0, 1, 0, 0, 0xFF81),       # -NaN -> +NaN
        P(0x3F80, 0x3F7F, 0, 1, 1, 1),            # 1.0 -> 1.0 - ulp
        P(0x3F80, 0xBF7F, 1, 1, 1, 0x7F00),
    ],
    "F16": [
        P(0x0000, 0x8000, 1, 0, 0, 1),
        P(0x7E00, 0x7E01, 0, 0, 1, 1),
        P(0x7C00, 0xFC00, 1, 0, 0, 0xF801),
        P(0x0001, 0x03FF, 0, 0, 1, 0x3FE),
        P(0x03FF, 0x0400, 0, 1, 1, 1),            # largest subnormal -> smallest normal
        P(0x3C00, 0x3C01, 0, 0, 1, 1),
    ],
    "F32": [
        P(0x00000000, 0x80000000, 1, 0, 0, 1),
        P(0x7FC00000, 0x7FC00001, 0, 0, 1, 1),
        P(0x7F800001, 0x7FC00001, 0, 0, 1, 0x400000),   # signalling -> quiet NaN
        P(0x7F800000, 0xFF800000, 1, 0, 0, 0xFF000001),
        P(0x00000001, 0x00000003, 0, 0, 1, 2),
        P(0x3F800000, 0x3F800001, 0, 0, 1, 1),
        P(0x3F800000, 0x40000000, 0, 1, 0, 0x800000),
    ],
    "F64": [
        P(0, 1 << 63, 1, 0, 0, 1),
        P(0x7FF8000000000000, 0x7FF8000000000001, 0, 0, 1, 1),
        P(0x7FF0000000000000, 0xFFF0000000000000, 1, 0, 0, 0xFFE0000000000001),
        P(1, 2, 0, 0, 1, 1),
        P(0x3FF0000000000000, 0xBFF0000000000000, 1, 0, 0, 0x7FE0000000000001),  # 1.0 -> -1.0
    ],
    "F8_E4M3": [
        P(0x00, 0x80, 1, 0, 0, 1),
        P(0x7F, 0xFF, 1, 0, 0, 255),              # NaN -> -NaN
        P(0x7E, 0x7F, 0, 0, 1, 1),                # max -> NaN
        P(0x01, 0x07, 0, 0, 1, 6),
        P(0x38, 0x40, 0, 1, 0, 8),                # 1.0 -> 2.0
    ],
    "F8_E5M2": [
        P(0x7C, 0xFC, 1, 0, 0, 249),              # inf -> -inf
        P(0x7D, 0x7E, 0, 0, 1, 1),                # NaN payload
        P(0x00, 0x80, 1, 0, 0, 1),
        P(0x01, 0x03, 0, 0, 1, 2),
    ],
    "F8_E4M3FNUZ": [P(0x00, 0x80, 1, 0, 0, 1), P(0x40, 0x41, 0, 0, 1, 1)],
    "F8_E5M2FNUZ": [P(0x04, 0x84, 1, 0, 0, 9)],
    "F8_E8M0": [P(0x7F, 0x80, 0, 1, 0, 1), P(0x00, 0xFF, 0, 1, 0, 255)],  # no sign, no mantissa
    "C64": [
        P((0, 0), (0x80000000, 0), 1, 0, 0, 1),
        P((0x3F800000, 0x7FC00000), (0x3F800000, 0x7FC00001), 0, 0, 1, 1),
        P((0x3F800000, 0x3F800000), (0x40000000, 0xBF800000), 1, 1, 0, 0x7F000001),
    ],
    "F4": [
        P(0x0, 0x8, 1, 0, 0, 1),
        P(0x7, 0xF, 1, 0, 0, 15),
        P(0x1, 0x2, 0, 1, 1, 1),
        P(0x2, 0x4, 0, 1, 0, 2),
    ],
    "F6_E2M3": [
        P(0x00, 0x20, 1, 0, 0, 1),
        P(0x1F, 0x3F, 1, 0, 0, 63),
        P(0x08, 0x10, 0, 1, 0, 8),
        P(0x01, 0x07, 0, 0, 1, 6),
    ],
    "F6_E3M2": [P(0x00, 0x20, 1, 0, 0, 1), P(0x04, 0x03, 0, 1, 1, 1)],
    "BOOL": [P(0, 1, ulp=1), P(1, 0, ulp=1)],
    "U8": [P(0, 255, ulp=255), P(7, 8, ulp=1)],
    "I8": [P(0x7F, 0x80, ulp=255), P(0x00, 0xFF, ulp=1), P(0x80, 0x81, ulp=1)],  # 127->-128, 0->-1
    "I16": [P(0x8000, 0x7FFF, ulp=0xFFFF), P(0xFFFF, 0x0001, ulp=2)],           # -1 -> 1
    "U16": [P(1, 0, ulp=1), P(0, 0xFFFF, ulp=0xFFFF)],
    "I32": [P(0x80000000, 0x7FFFFFFF, ulp=0xFFFFFFFF), P(0, 0x80000000, ulp=1 << 31)],
    "U32": [P(0, 0xFFFFFFFF, ulp=0xFFFFFFFF)],
    "I64": [P(1 << 63, (1 << 63) - 1, ulp=(1 << 64) - 1), P((1 << 64) - 1, 0, ulp=1)],
    "U64": [P(0, (1 << 64) - 1, ulp=(1 << 64) - 1), P(5, 3, ulp=2)],
}
# An unchanged value for each dtype (bits), used to fill the tensors.
FILL = {"BF16": 0x3F80, "F16": 0x3C00, "F32": 0x3F800000, "F64": 0x3FF0000000000000, "C64": (0x3F800000, 0),
        "F8_E4M3": 0x38, "F8_E5M2": 0x3C, "F8_E4M3FNUZ": 0x40, "F8_E5M2FNUZ": 0x40, "F8_E8M0": 0x7F,
        "F4": 0x2, "F6_E2M3": 0x08, "F6_E3M2": 0x0C}
TORCH_WRITABLE = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
                  "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
                  "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
                  "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def pack(dtype: str, values: list) -> bytes:
    """Little-endian bytes of `values` (bit patterns) in `dtype`'s layout."""
    bits = DTYPES[dtype][0]
    if dtype == "C64":
        return np.array([lane for v in values for lane in v], dtype="<u4").tobytes()
    if bits >= 8:
        return np.array(values, dtype=f"<u{bits // 8}").tobytes()
    assert len(values) * bits % 8 == 0
    v = np.asarray(values, dtype=np.uint8)  # packed little-endian bit stream
    stream = ((v[:, None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(-1)
    return np.packbits(stream, bitorder="little").tobytes()


def to_torch(dtype: str, data: bytes, shape):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return t.view(getattr(torch, TORCH_WRITABLE[dtype])).reshape(shape)


def planted_tensor(dtype: str, n: int, positions: list[int]):
    plants = PLANTS[dtype]
    fill = FILL.get(dtype, 7 if dtype != "BOOL" else 1)
    old, new = [fill] * n, [fill] * n
    for pos, p in zip(positions, plants):
        old[pos], new[pos] = p.old, p.new
    return pack(dtype, old), pack(dtype, new)


def write_pair(root, tensors_a: dict, tensors_b: dict):
    """tensors: name -> (dtype, shape, bytes). torch writes what it can, the rest is written raw."""
    for side, tensors in (("a", tensors_a), ("b", tensors_b)):
        d = root / side
        d.mkdir()
        torch_part = {k: to_torch(dt, data, shape) for k, (dt, shape, data) in tensors.items() if dt in TORCH_WRITABLE}
        safetensors.torch.save_file(torch_part, str(d / "torch.safetensors"), metadata={"format": "pt"})
        raw = {k: v for k, v in tensors.items() if k not in torch_part}
        header, blob = {}, b""
        for k, (dt, shape, data) in raw.items():
            header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [len(blob), len(blob) + len(data)]}
            blob += data
        write_raw_safetensors(d / "raw.safetensors", header, blob)
    return root / "a", root / "b"


def expected_for(dtype: str) -> dict:
    plants = [p for p in PLANTS[dtype] if p.old != p.new]
    return {"changed": len(plants), "sign": sum(p.sign for p in plants), "exponent": sum(p.exponent for p in plants),
            "mantissa": sum(p.mantissa for p in plants), "max_ulp": max(p.ulp for p in plants)}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    ta, tb = {}, {}
    for dtype, plants in PLANTS.items():
        bits = DTYPES[dtype][0]
        n = 40  # a multiple of 4 so F4 and F6 fill whole bytes
        positions = [(3 + 7 * i) % n for i in range(len(plants))]  # scattered, across byte boundaries
        a, b = planted_tensor(dtype, n, positions)
        shape = (5, 8) if bits >= 8 else (n,)
        ta[f"planted.{dtype}"] = (dtype, shape, a)
        tb[f"planted.{dtype}"] = (dtype, shape, b)
        # One unchanged tensor of every dtype and one empty tensor.
        ta[f"same.{dtype}"] = tb[f"same.{dtype}"] = (dtype, shape, b)
        ta[f"empty.{dtype}"] = tb[f"empty.{dtype}"] = (dtype, (0, 3), b"")
    # Changes on either side of the 2^20-element pieces dcr splits tensors into.
    big = (1 << 20) + 8
    for dtype, pos in (("BF16", [0, (1 << 20) - 1, 1 << 20, big - 1]),
                       ("F4", [1, (1 << 20) - 1, 1 << 20, big - 1]),
                       ("F6_E2M3", [0, (1 << 20) - 1, 1 << 20, big - 2])):
        a, b = planted_tensor(dtype, big, pos)
        ta[f"big.{dtype}"] = (dtype, (big,), a)
        tb[f"big.{dtype}"] = (dtype, (big,), b)
    a_dir, b_dir = write_pair(root, ta, tb)
    rc, doc = diff(a_dir, b_dir)
    return {"rc": rc, "doc": doc, "a": read_checkpoint(a_dir), "b": read_checkpoint(b_dir), "dirs": (a_dir, b_dir)}


def test_planted_reference_is_sane():
    """The numpy reference reproduces the hand-computed table (so both are right or both wrong)."""
    for dtype in PLANTS:
        a, b = planted_tensor(dtype, 40, list(range(len(PLANTS[dtype]))))
        r = ref_stats(dtype, a, b)
        e = expected_for(dtype)
        assert (r["changed"], r["sign"], r["exponent"], r["mantissa"], r["max_ulp"]) == (
            e["changed"], e["sign"], e["exponent"], e["mantissa"], e["max_ulp"]), dtype


def test_planted_exit_code_and_totals(planted):
    assert planted["rc"] == 1
    check_diff(planted["doc"], planted["a"], planted["b"])
    names = {t["name"] for t in planted["doc"]["tensors"]}
    assert {f"planted.{d}" for d in PLANTS} <= names and {f"empty.{d}" for d in PLANTS} <= names


@pytest.mark.parametrize("dtype", list(PLANTS))
def test_planted_change_counted(planted, dtype):
    t = {t["name"]: t for t in planted["doc"]["tensors"]}[f"planted.{dtype}"]
    e = expected_for(dtype)
    assert t["dtype"] == dtype
    assert t["elements"] == 40
    assert t["changed_elements"] == e["changed"]
    assert t["max_ulp"] == e["max_ulp"]
    if dtype in FLOATY:
        assert (t["sign_changed"], t["exponent_changed"], t["mantissa_changed"]) == (
            e["sign"], e["exponent"], e["mantissa"])
    same = {t["name"]: t for t in planted["doc"]["tensors"]}[f"same.{dtype}"]
    assert same["changed_elements"] == 0 and same["max_ulp"] == 0
    empty = {t["name"]: t for t in planted["doc"]["tensors"]}[f"empty.{dtype}"]
    assert empty["elements"] == 0 and empty["changed_elements"] == 0 and empty["changed_percent"] == 0


@pytest.mark.parametrize("dtype", ["BF16", "F4", "F6_E2M3"])
def test_planted_across_piece_boundaries(planted, dtype):
    t = {t["name"]: t for t in planted["doc"]["tensors"]}[f"big.{dtype}"]
    plants = PLANTS[dtype][:4]
    assert t["elements"] == (1 << 20) + 8
    assert t["changed_elements"] == sum(p.old != p.new for p in plants)
    assert t["sign_changed"] == sum(p.sign for p in plants)
    assert t["exponent_changed"] == sum(p.exponent for p in plants)
    assert t["mantissa_changed"] == sum(p.mantissa for p in plants)
    assert t["max_ulp"] == max(p.ulp for p in plants)


def test_planted_diff_is_symmetric(planted):
    a_dir, b_dir = planted["dirs"]
    rc, back = diff(b_dir, a_dir)
    assert rc == 1
    check_diff(back, planted["b"], planted["a"])
    fwd = planted["doc"]
    for k in ("changed_elements", "sign_changed", "exponent_changed", "mantissa_changed", "max_ulp"):
        assert back[k] == fwd[k], k


def test_single_element_changes_in_numpy_files(tmp):
    """One flipped bit per tensor, files written by safetensors.numpy."""
    import safetensors.numpy
    rng = np.random.default_rng(5)
    a = {"f32": rng.standard_normal((64, 3)).astype(np.float32),
         "f64": rng.standard_normal(100),
         "f16": rng.standard_normal(33).astype(np.float16),
         "i32": rng.integers(-1000, 1000, 50).astype(np.int32),
         "scalar": np.array(1.5, dtype=np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    b["f32"].view(np.uint32)[10, 1] ^= 1 << 22            # top mantissa bit
    b["f64"].view(np.uint64)[99] ^= np.uint64(1 << 63)   # sign
    b["f16"].view(np.uint16)[0] ^= 1 << 10               # lowest exponent bit
    b["i32"][7] += 3
    b["scalar"][()] = np.float32(-1.5)
    safetensors.numpy.save_file(a, str(tmp / "a.safetensors"))
    safetensors.numpy.save_file(b, str(tmp / "b.safetensors"))
    rc, doc = diff(tmp / "a.safetensors", tmp / "b.safetensors")
    assert rc == 1
    check_diff(doc, read_checkpoint(tmp / "a.safetensors"), read_checkpoint(tmp / "b.safetensors"))
    t = {x["name"]: x for x in doc["tensors"]}
    assert (t["f32"]["changed_elements"], t["f32"]["mantissa_changed"], t["f32"]["max_ulp"]) == (1, 1, 1 << 22)
    assert (t["f64"]["changed_elements"], t["f64"]["sign_changed"], t["f64"]["exponent_changed"]) == (1, 1, 0)
    assert (t["f16"]["exponent_changed"], t["f16"]["mantissa_changed"], t["f16"]["max_ulp"]) == (1, 0, 1 << 10)
    assert (t["i32"]["changed_elements"], t["i32"]["max_ulp"]) == (1, 3)
    assert (t["scalar"]["elements"], t["scalar"]["changed_elements"], t["scalar"]["sign_changed"]) == (1, 1, 1)
    assert doc["changed_elements"] == 5


# ------------------------------------------------- structural differences

def test_only_in_one_side_and_mismatches(tmp):
    f32 = lambda *s: torch.arange(math.prod(s), dtype=torch.float32).reshape(s)  # noqa: E731
    a = {"same": f32(2, 3), "gone": f32(4), "dtype": f32(4).to(torch.bfloat16), "shape": f32(2, 2),
         "rank": f32(6)}
    b = {"same": f32(2, 3), "new": f32(3), "dtype": f32(4).to(torch.float16), "shape": f32(4),
         "rank": f32(6).reshape(1, 6)}
    safetensors.torch.save_file(a, str(tmp / "a.safetensors"))
    safetensors.torch.save_file(b, str(tmp / "b.safetensors"))
    rc, doc = diff(tmp / "a.safetensors", tmp / "b.safetensors")
    assert rc == 1 and doc["identical"] is False
    assert doc["only_in_a"] == ["gone"]
    assert doc["only_in_b"] == ["new"]
    assert sorted(m.split(":")[0] for m in doc["mismatched"]) == ["dtype", "rank", "shape"]
    mism = {m.split(":")[0]: m for m in doc["mismatched"]}
    assert "BF16" in mism["dtype"] and "F16" in mism["dtype"]
    assert [t["name"] for t in doc["tensors"]] == ["same"]
    assert doc["changed_elements"] == 0  # no bits differ where comparable, yet the files differ
    check_diff(doc, read_checkpoint(tmp / "a.safetensors"), read_checkpoint(tmp / "b.safetensors"))
    # Text output lists them too.
    r = run_dcr("diff", tmp / "a.safetensors", tmp / "b.safetensors")
    assert r.returncode == 1
    for word in ("gone", "new", "dtype", "shape", "rank"):
        assert word in r.stdout


@pytest.mark.parametrize("case", ["only_in_a", "only_in_b", "mismatched"])
def test_each_structural_difference_alone_exits_1(tmp, case):
    x = torch.ones(3)
    a, b = {"x": x}, {"x": x}
    if case == "only_in_a":
        a["extra"] = x.clone()
    elif case == "only_in_b":
        b["extra"] = x.clone()
    else:
        b["x"] = x.reshape(3, 1)
    safetensors.torch.save_file(a, str(tmp / "a.safetensors"))
    safetensors.torch.save_file(b, str(tmp / "b.safetensors"))
    rc, doc = diff(tmp / "a.safetensors", tmp / "b.safetensors")
    assert rc == 1 and doc["identical"] is False and doc["changed_elements"] == 0
    assert len(doc[case]) == 1


def test_empty_checkpoints_are_identical(tmp):
    safetensors.torch.save_file({}, str(tmp / "a.safetensors"))
    safetensors.torch.save_file({"e": torch.empty(0, 4)}, str(tmp / "b.safetensors"))
    rc, doc = diff(tmp / "a.safetensors", tmp / "a.safetensors")
    assert rc == 0 and doc["total_elements"] == 0 and doc["changed_percent"] == 0
    rc, doc = diff(tmp / "a.safetensors", tmp / "b.safetensors")
    assert rc == 1 and doc["only_in_b"] == ["e"]
