#!/usr/bin/env python3
"""Writes a seed corpus of small safetensors files (valid and subtly broken)
into the directory given as argv[1]. Standard library only."""
import json
import os
import struct
import sys


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


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
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
