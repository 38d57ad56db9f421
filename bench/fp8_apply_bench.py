#!/usr/bin/env python3
"""An FP8 engine's apply against a BF16 engine's, over the same deltas.

A BF16 trainer's model (engine_apply_bench's Qwen3-like shapes, seeded) and
versions changing ``--rates`` of its elements by one ulp; deltas made by
dcr.Sender. Two engines on the CPU, in one process, apply each delta:

  BF16  dcr.Receiver over BF16 tensors (applied in place in host memory);
  FP8   dcr.Receiver(fp8=...) over E4M3 weights and block scales: the frames
        applied to its BF16 master, every 128 x 128 block holding a changed
        element requantized (docs/layouts.md, "FP8 engines").

Both download the same bytes (the delta's frames). Baseline from the same
run: what dcr did for an FP8 engine before, every tensor that changed resent
whole (its BF16 bytes, as full-chunk overwrites) and requantized whole; its
compute is timed here as dcr.quantize_fp8_blocks over every such tensor.
At the end the FP8 engine's weights and scales are checked bit for bit
against dcr.quantize_fp8_blocks of the trainer's last version.

  .venv/bin/python bench/fp8_apply_bench.py [--size 1GB] [--rates 0.001,0.01,0.03] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import dcr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_apply_bench import model, parse_size, step  # noqa: E402


def fp8_engine(canonical: dict) -> tuple:
    """E4M3 tensors and scales for every 2-D tensor, BF16 for the others, and the receiver's fp8 argument."""
    tensors, scales = {}, {}
    for n, t in canonical.items():
        if t.dim() == 2:
            tensors[n] = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
            scales[n] = torch.empty(((t.shape[0] + 127) // 128, (t.shape[1] + 127) // 128))
        else:
            tensors[n] = t.clone()
    return tensors, scales


def run(args) -> dict:
    trainer = model(parse_size(args.size))
    model_bytes = sum(t.numel() * 2 for t in trainer.values())
    print(f"fp8 apply bench: a {model_bytes / 1e9:.2f} GB BF16 model, rates {args.rates}", flush=True)
    sender = dcr.Sender(trainer)
    bf16 = dcr.Receiver({n: t.clone() for n, t in trainer.items()})
    tensors, scales = fp8_engine(trainer)
    t0 = time.perf_counter()
    fp8 = dcr.Receiver(tensors, fp8=scales)
    fp8.load(trainer)
    out = {"model_bytes": model_bytes, "join_seconds": time.perf_counter() - t0, "versions": []}
    total_blocks = sum(s.numel() for s in scales.values())
    for v, rate in enumerate([0.0] + args.rates):
        if rate > 0:
            step(trainer, rate, seed=v)
        delta = sender.make_delta()
        t0 = time.perf_counter()
        bf16.apply(delta)
        bf16_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = fp8.apply(delta)
        fp8_s = time.perf_counter() - t0
        sender.commit(delta)
        changed = {json.loads(delta.manifest_json)["tensors"][f["tensor"]]["name"]
                   for f in json.loads(delta.manifest_json)["frames"]}
        t0 = time.perf_counter()
        for n in changed:
            if trainer[n].dim() == 2:
                dcr.quantize_fp8_blocks(trainer[n])
        whole_s = time.perf_counter() - t0
        whole_bytes = sum(trainer[n].numel() * 2 for n in changed)
        row = {"version": v, "rate": rate, "frame_bytes": delta.frame_bytes, "bf16_seconds": bf16_s,
               "fp8_seconds": fp8_s, "blocks": report["fp8_blocks_requantized"], "total_blocks": total_blocks,
               "whole_bytes": whole_bytes, "whole_requantize_seconds": whole_s,
               "master_bytes": report["fp8_master_bytes"]}
        out["versions"].append(row)
        print(f"  version {v}: {rate:.1%} changed, {delta.frame_bytes / 1e6:.2f} MB of frames, BF16 {bf16_s:.3f} s, "
              f"FP8 {fp8_s:.3f} s ({row['blocks']} of {total_blocks} blocks)", flush=True)
    exact = all(
        torch.equal(tensors[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales[n], s)
        for n in scales for q, s in [dcr.quantize_fp8_blocks(trainer[n])])
    out["exact"] = exact and bf16.digest() == fp8.digest()
    return out


def report(out: dict, args) -> None:
    mb = 1e6
    print(f"\nmodel {out['model_bytes'] / 1e9:.2f} GB; FP8 join (load + quantize every block) "
          f"{out['join_seconds']:.2f} s; FP8 engine exact at the last version: {out['exact']}")
    print("| version | changed | frames MB | whole tensors MB (before) | BF16 apply s | FP8 apply s | FP8 / BF16 | "
          "blocks requantized | whole requantize s (before) | FP8 master MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [r for r in out["versions"] if r["rate"] > 0]
    for r in rows:
        print(f"| {r['version']} | {r['rate']:.1%} | {r['frame_bytes'] / mb:.2f} | {r['whole_bytes'] / mb:.0f} | "
              f"{r['bf16_seconds']:.3f} | {r['fp8_seconds']:.3f} | {r['fp8_seconds'] / r['bf16_seconds']:.1f} | "
              f"{r['blocks'] / r['total_blocks']:.1%} | {r['whole_requantize_seconds']:.3f} | "
              f"{r['master_bytes'] / mb:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        rates = [100 * r["rate"] for r in rows]
        ax[0].plot(rates, [r["frame_bytes"] / mb for r in rows], "o-", label="FP8 and BF16 engines (the frames)")
        ax[0].plot(rates, [r["whole_bytes"] / mb for r in rows], "o-", label="FP8 before (whole tensors)")
        ax[0].set(xlabel="% of elements changed", ylabel="MB per version", yscale="log", title="bytes downloaded")
        ax[1].plot(rates, [r["bf16_seconds"] for r in rows], "o-", label="BF16 engine")
        ax[1].plot(rates, [r["fp8_seconds"] for r in rows], "o-", label="FP8 engine")
        ax[1].plot(rates, [r["whole_requantize_seconds"] for r in rows], "o--", label="requantize whole (before)")
        ax[1].set(xlabel="% of elements changed", ylabel="seconds per version", title="apply time (CPU)")
        for a in ax:
            a.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GB")
    ap.add_argument("--rates", default="0.001,0.01,0.03")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    out = run(args)
    report(out, args)
    return 0 if out["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
