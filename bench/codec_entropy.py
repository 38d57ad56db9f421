#!/usr/bin/env python3
"""Where the bytes per changed element could go (issue 24, item 5): a model of the
codec's sparse coding next to one more coding and to the data's entropy floors.

For each pair of checkpoints (BF16 tensors, chunks of 2^20 elements as the codec
cuts them; other dtypes are left out) it prints bytes per changed element:

  codec model       docs/format.md's sparse coding, best parameters per chunk: the gaps
                    as Rice(kg); the values as add (a sign, Exp-Golomb(kv) of |d| - 1)
                    or xor (Exp-Golomb of the length, the bits below the top one),
                    whichever is smaller. It tracks `dcr delta make` (the test checks it
                    within 2%); the codec chooses parameters on a sample, so it is
                    slightly larger.
  classes K         the same codes, with the chunk's elements split into K classes by
                    the old word's exponent (thresholds at the quantiles of the changed
                    elements' exponents; a receiver knows every old word, so it knows
                    every element's class): each class's changes coded as their own gap
                    sequence and values with their own parameters. Header: a byte per
                    threshold, 9 bits of parameters per class.
  floor iid         the entropy of positions drawn independently at the chunk's rate,
                    H(p)/p per change, plus the values' empirical entropy H(d | exponent)
  floor exponent    positions' entropy given the old exponent (per tensor), plus the same
                    values: what the issue's "about 0.81" estimate measures

  bench/codec_entropy.py --dcr build/tools/dcr/dcr                # generated 64 MB pairs
  bench/codec_entropy.py --pair BASE NEW [--pair BASE NEW ...]     # checkpoints of your own
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHUNK = 1 << 20


def load_bf16(path: Path) -> dict[str, np.ndarray]:
    """Every BF16 tensor of a safetensors file or directory, as uint16 words."""
    out = {}
    for f in sorted([path] if path.is_file() else path.glob("*.safetensors")):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        for name, t in header.items():
            if name != "__metadata__" and t["dtype"] == "BF16":
                s, e = t["data_offsets"]
                out[name] = np.frombuffer(raw, dtype=np.uint16, count=(e - s) // 2, offset=8 + n + s)
    return out


def image(x: np.ndarray) -> np.ndarray:
    """docs/format.md's order-preserving image of BF16 words (mode add)."""
    x = x.astype(np.int64)
    return np.where(x & 0x8000, ~x & 0xFFFF, x | 0x8000)


def rice_bits(v: np.ndarray, k: int) -> int:
    return int(((v >> k) + 1 + k).sum())


def exp_golomb_bits(v: np.ndarray, k: int) -> int:
    length = np.floor(np.log2(v + (1 << k))).astype(np.int64) + 1
    return int((2 * (length - 1) - k + 1).sum())


def best_rice(gaps: np.ndarray) -> int:
    return min(rice_bits(gaps, k) for k in range(24)) if gaps.size else 0


def best_exp_golomb(v: np.ndarray, ks=range(12)) -> int:
    return min(exp_golomb_bits(v, k) for k in ks) if v.size else 0


def gaps_of(changed: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(changed)
    return np.diff(idx, prepend=-1) - 1


def value_bits(old: np.ndarray, new: np.ndarray) -> int:
    """The smaller of add and xor values for these changes."""
    add = np.abs(image(new) - image(old)) - 1
    xor = (old ^ new).astype(np.int64)
    length = np.floor(np.log2(xor)).astype(np.int64) + 1
    return min(best_exp_golomb(add) + add.size, best_exp_golomb(length - 1, range(6)) + int((length - 1).sum()))


def classes_bits(old: np.ndarray, new: np.ndarray, k: int) -> int:
    """One chunk with its elements split into k classes by the old exponent."""
    changed = old != new
    exponent = (old >> 7) & 0xFF
    cuts = np.unique(np.quantile(exponent[changed], np.linspace(0, 1, k + 1)[1:-1]).round().astype(np.int64))
    cls = np.searchsorted(cuts, exponent, side="right")
    bits = 8 * cuts.size
    for c in range(cuts.size + 1):
        members = cls == c
        sub = changed[members]
        bits += 9 + best_rice(gaps_of(sub)) + value_bits(old[members][sub], new[members][sub])
    return bits


def entropy(counts: np.ndarray) -> float:
    """Bits to code every sample whose value counts are `counts`, at their frequencies."""
    counts = counts[counts > 0].astype(np.float64)
    return float(-(counts * np.log2(counts / counts.sum())).sum())


def binary_entropy(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def estimate(base: Path, new: Path, ks=(2, 4)) -> dict:
    a_all, b_all = load_bf16(base), load_bf16(new)
    model = changes = 0
    classes = dict.fromkeys(ks, 0)
    iid_positions = exponent_positions = 0.0
    pairs = []  # (old exponent, value) of every change, for H(d | exponent)
    for name, a in a_all.items():
        b = b_all[name]
        for c0 in range(0, a.size, CHUNK):
            old, nxt = a[c0:c0 + CHUNK], b[c0:c0 + CHUNK]
            changed = old != nxt
            n = int(changed.sum())
            if n == 0:
                continue
            changes += n
            model += best_rice(gaps_of(changed)) + value_bits(old[changed], nxt[changed])
            for k in ks:
                classes[k] += classes_bits(old, nxt, k)
            iid_positions += old.size * float(binary_entropy(np.array(n / old.size)))
        changed = a != b
        exponent = ((a >> 7) & 0xFF).astype(np.int64)
        every, moved = np.bincount(exponent, minlength=256), np.bincount(exponent[changed], minlength=256)
        rate = np.divide(moved, every, out=np.zeros(256), where=every > 0)
        exponent_positions += float((every * binary_entropy(rate)).sum())
        d = image(b[changed]) - image(a[changed])
        pairs.append(exponent[changed] * (1 << 17) + (d + (1 << 16)))
    pairs = np.concatenate(pairs) if pairs else np.zeros(0, np.int64)
    _, pair_counts = np.unique(pairs, return_counts=True)
    _, exponent_counts = np.unique(pairs >> 17, return_counts=True)
    values = entropy(pair_counts) - entropy(exponent_counts)  # H(d | exponent), in bits over all changes
    per = 8.0 * max(changes, 1)
    return {"changes": changes, "codec model": model / per,
            **{f"classes {k}": classes[k] / per for k in ks},
            "floor iid": (iid_positions + values) / per, "floor exponent": (exponent_positions + values) / per}


def generate(dcr: str, work: Path, update: str, rate: float, size: str) -> tuple[Path, Path]:
    out = work / f"{update}-{rate}"
    subprocess.run([dcr, "gen", "-o", str(out), "--size", size, "--rate", str(rate), "--update", update,
                    "--seed", "3"], check=True, stdout=subprocess.DEVNULL)
    return out / "v0", out / "v1"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcr", default="build/tools/dcr/dcr")
    ap.add_argument("--size", default="64MB")
    ap.add_argument("--pair", nargs=2, action="append", metavar=("BASE", "NEW"), help="checkpoints to compare")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcr-entropy-") as tmp:
        if a.pair:
            pairs = [(f"{x} -> {Path(y).name}"[-28:], Path(x), Path(y)) for x, y in a.pair]
        else:
            pairs = [(f"{u} {r:.0%}", *generate(a.dcr, Path(tmp), u, r, a.size))
                     for u, r in (("training", 0.01), ("training", 0.03), ("training", 0.05),
                                  ("stress", 0.03), ("stress", 0.05))]
        cols = ["codec model", "classes 2", "classes 4", "floor iid", "floor exponent"]
        print(f"{'data set':<28} " + " ".join(f"{c:>14}" for c in cols) + "   (bytes per changed element)")
        for label, base, new in pairs:
            r = estimate(base, new)
            print(f"{label:<28} " + " ".join(f"{r[c]:>14.3f}" for c in cols), flush=True)


if __name__ == "__main__":
    sys.exit(main())
