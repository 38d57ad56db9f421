#!/usr/bin/env python3
"""Writes seed corpora for the fuzz targets: OUT/safetensors_header_fuzz
(small safetensors files, valid and subtly broken), and, using the dcr binary
given as argv[2], OUT/frame_fuzz (single frames of real deltas in every mode)
and OUT/manifest_fuzz (their manifests). Standard library only.

usage: seeds.py OUT DCR_BINARY
"""
import json
import os
import struct
import subprocess
import sys
import tempfile


def safetensors(tensors, metadata=None, pad=True, data_extra=b""):
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    data = b""
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        data += bytes((offset + i) & 0xFF for i in range(nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data + data_extra


def delta_seeds(dcr, frames_out, manifests_out):
    """Small deltas in both classes; every frame becomes one seed file."""
    os.makedirs(frames_out, exist_ok=True)
    os.makedirs(manifests_out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([dcr, "gen", "-o", f"{tmp}/g", "--family", "deepseek-v3", "--size", "1MB",
                        "--versions", "1", "--rate", "0.05", "--seed", "5"], check=True, capture_output=True)
        n = 0
        for mode, chunk, extra in (("xor", "4096", []), ("xor", "65536", ["--no-add"]), ("overwrite", "2048", [])):
            d = f"{tmp}/d-{mode}-{chunk}-{len(extra)}"
            subprocess.run([dcr, "delta", "make", f"{tmp}/g/v0", f"{tmp}/g/v1", "-o", d, "--mode", mode,
                            "--chunk", chunk, *extra], check=True, capture_output=True)
            with open(f"{d}/manifest.json", "rb") as f:
                manifest = f.read()
            with open(os.path.join(manifests_out, f"manifest-{n}"), "wb") as f:
                f.write(manifest)
            doc = json.loads(manifest)
            small = dict(doc, tensors=doc["tensors"][:2], frames=[f for f in doc["frames"] if f["tensor"] < 2][:3])
            with open(os.path.join(manifests_out, f"manifest-small-{n}"), "w") as f:
                json.dump(small, f)
            data = open(f"{d}/frames.bin", "rb").read()
            for entry in doc["frames"][:40]:
                frame = data[entry["offset"]:entry["offset"] + entry["bytes"]]
                if len(frame) > 64 << 10:
                    continue  # keep seeds small
                for variant, first in (("checked", frame[0]), ("resealed", frame[0] | 1)):
                    with open(os.path.join(frames_out, f"frame-{n}-{variant}"), "wb") as f:
                        f.write(bytes([first]) + frame[1:])
                n += 1


def main():
    out = os.path.join(sys.argv[1], "safetensors_header_fuzz")
    os.makedirs(out, exist_ok=True)
    delta_seeds(sys.argv[2], os.path.join(sys.argv[1], "frame_fuzz"), os.path.join(sys.argv[1], "manifest_fuzz"))
    seeds = {
        "empty_header": safetensors([]),
        "one_bf16": safetensors([("w", "BF16", [2, 3], 12)]),
        "metadata": safetensors([("a", "F32", [4], 16)], metadata={"format": "pt"}),
        "all_dtypes": safetensors([
            ("b", "BOOL", [3], 3), ("u8", "U8", [2], 2), ("i8", "I8", [2], 2), ("i16", "I16", [2], 4),
            ("u16", "U16", [1], 2), ("f16", "F16", [2], 4), ("bf", "BF16", [2], 4), ("i32", "I32", [1], 4),
            ("u32", "U32", [1], 4), ("f32", "F32", [1], 4), ("f64", "F64", [1], 8), ("i64", "I64", [1], 8),
            ("u64", "U64", [1], 8), ("c64", "C64", [1], 8), ("e4", "F8_E4M3", [2], 2),
            ("e5", "F8_E5M2", [2], 2), ("e8", "F8_E8M0", [1], 1), ("e4u", "F8_E4M3FNUZ", [1], 1),
            ("e5u", "F8_E5M2FNUZ", [1], 1), ("f4", "F4", [4], 2), ("f6a", "F6_E2M3", [4], 3),
            ("f6b", "F6_E3M2", [4], 3)]),
        "scalar_and_empty": safetensors([("s", "F32", [], 4), ("z", "F16", [0, 5], 0)]),
        "unpadded": safetensors([("w", "I64", [1], 8)], pad=False),
        "trailing": safetensors([("w", "U8", [1], 1)], data_extra=b"x"),
        "truncated": safetensors([("w", "F64", [4], 32)])[:-5],
    }
    for name, blob in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(blob)


if __name__ == "__main__":
    main()
