#!/usr/bin/env python3
"""The engine's side of a refit: a version applied to a model held as torch tensors.

Two paths over the same deltas, in the same run, each in a fresh process:

  in place  dcr.Receiver(tensors, stage=True): frames decoded on the host, the
            old words at the changed positions gathered through torch and the
            new ones scattered into the tensors where they live (on CUDA, the
            device; on CPU, through the same torch index copies);
  staged    the path dcr took before (its baseline here): a host mirror of
            every tensor, frames applied to the mirror, and every tensor a
            version touched copied back whole.

Data: a ``--size`` model of BF16 tensors (Qwen3-like shapes, seeded), and
versions at each of ``--rates`` of elements changed (each change one BF16
ulp up or down, as optimizer steps round), deltas made by dcr.Sender and kept
in ``--dir``. Per version: seconds to apply (and copy back), and host memory
held: the frames (the delta in memory) plus the peak resident memory the
apply added (VmHWM, reset before it), plus the mirror for the staged path.
A warm-up version (nothing changed) computes the receivers' chunk digests
first. After the last version each path times a recheck: every chunk's
digest computed again from the bits (what ``Receiver.follow(recheck=True)``,
the default, does before each update). On CUDA the device's own device-to-device copy of the model is timed
in the same process, for the apply's throughput against it.

  .venv/bin/python bench/engine_apply_bench.py [--size 2GB] [--rates 0.001,0.01,0.03] [--device cpu|cuda]
      [--dir /dev/shm/dcr-engine-apply] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import dcr

SHAPES = [  # (rows, cols) of one layer, Qwen3-like
    (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),  # q, k, v, o
    (12288, 4096), (12288, 4096), (4096, 12288),  # gate, up, down
    (4096,), (4096,),  # norms
]


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for u, m in units.items():
        if text.upper().endswith(u):
            return int(float(text[:-2]) * m)
    return int(text)


def model(size: int) -> dict:
    """Seeded BF16 tensors of about `size` bytes."""
    gen = torch.Generator().manual_seed(42)
    out, total, layer = {}, 0, 0
    while total < size:
        for k, shape in enumerate(SHAPES):
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            out[f"layers.{layer}.t{k}"] = t
            total += t.numel() * 2
        layer += 1
    return out


def step(tensors: dict, rate: float, seed: int) -> None:
    """Changes about `rate` of each tensor's elements by one ulp, in place."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        words = t.view(-1).view(torch.int16)
        n = max(1, int(words.numel() * rate))
        at = torch.randint(0, words.numel(), (n,), generator=gen)
        words[at] += (torch.randint(0, 2, (n,), generator=gen, dtype=torch.int16) * 2 - 1)


def prepare(args, root: Path) -> list:
    """The model (v0.safetensors) and one delta per rate, made once."""
    from safetensors.torch import save_file

    meta = root / "versions.json"
    want = {"size": args.size, "rates": args.rates}
    if meta.exists() and json.loads(meta.read_text()).get("want") == want:
        return json.loads(meta.read_text())["versions"]
    root.mkdir(parents=True, exist_ok=True)
    tensors = model(parse_size(args.size))
    save_file(tensors, str(root / "v0.safetensors"))
    sender = dcr.Sender(tensors)
    versions = []
    for v, rate in enumerate([0.0] + args.rates):
        if rate > 0:
            step(tensors, rate, seed=v)
        delta = sender.make_delta()
        out = root / f"d{v}"
        if out.exists():
            shutil.rmtree(out)
        delta.write(str(out))
        sender.commit(delta)
        versions.append({"version": v, "rate": rate, "dir": str(out), "frame_bytes": delta.frame_bytes,
                         "changed": delta.changed_words, "target": delta.target_digest})
        print(f"  version {v}: {rate:.1%} changed, {versions[-1]['frame_bytes'] / 1e6:.2f} MB of frames", flush=True)
    meta.write_text(json.dumps({"want": want, "versions": versions}))
    return versions


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(path: str, device: str, root: Path, versions: list) -> dict:
    """One path in this process: load the model, apply every version."""
    from safetensors.torch import load_file

    # Copies in memory of their own: loaded tensors may share the file's
    # pages, whose first writes would cost a copy-on-write fault each.
    live = {n: t.to(device, copy=True) for n, t in load_file(str(root / "v0.safetensors")).items()}
    model_bytes = sum(t.numel() * t.element_size() for t in live.values())
    out = {"path": path, "device": device, "model_bytes": model_bytes, "versions": []}
    if path == "inplace":
        rx = dcr.Receiver(live, stage=True)
        mirror_bytes = 0
    else:
        mirrors = {n: t.to("cpu", copy=True) for n, t in live.items()}
        rx = dcr.Receiver(mirrors, stage=False)
        mirror_bytes = model_bytes
    if device == "cuda":
        t0 = time.perf_counter()
        for t in live.values():
            t.clone()
        sync(device)
        out["d2d_copy_seconds"] = time.perf_counter() - t0
    for v in versions:
        delta = dcr.read_delta(v["dir"])
        touched = {json.loads(delta.manifest_json)["tensors"][f["tensor"]]["name"]
                   for f in json.loads(delta.manifest_json)["frames"]}
        sync(device)
        reset_peak()
        before = rss_bytes("VmRSS")
        t0 = time.perf_counter()
        report = rx.apply(delta)
        if path == "staged":
            for n in touched:
                live[n].copy_(mirrors[n])
        sync(device)
        seconds = time.perf_counter() - t0
        peak = rss_bytes("VmHWM") - before
        out["versions"].append({"version": v["version"], "rate": v["rate"], "seconds": seconds,
                                "frame_bytes": v["frame_bytes"], "peak_added_bytes": max(peak, 0),
                                "held_bytes": v["frame_bytes"] + max(peak, 0) + mirror_bytes,
                                "scratch_peak_bytes": report.get("scratch_peak_bytes", 0),
                                "tensors_touched": len(touched)})
    # A recheck (Receiver.follow's default before each update): every chunk's
    # digest computed again from the bits the receiver holds.
    sync(device)
    t0 = time.perf_counter()
    rx.forget_digests()
    rx.digest()
    out["recheck_seconds"] = time.perf_counter() - t0
    # The tensors end at the last version, bit for bit (its digest, from the live tensors).
    final = dcr.Receiver(live, stage=True).digest()
    out["exact"] = final == versions[-1]["target"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--rates", default="0.001,0.01,0.03")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dir", default="/dev/shm/dcr-engine-apply")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one path in a fresh process
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    root = Path(args.dir)
    if args.measure:
        versions = json.loads((root / "versions.json").read_text())["versions"]
        print(json.dumps(measure(args.measure, args.device, root, versions)))
        return 0
    print(f"engine apply bench: {args.size} model, rates {args.rates}, device {args.device}", flush=True)
    versions = prepare(args, root)
    results = {}
    for path in ("staged", "inplace"):
        print(f"  measuring the {path} path (a fresh process)", flush=True)
        cmd = [sys.executable, __file__, "--measure", path, "--device", args.device, "--dir", str(root),
               "--size", args.size, "--rates", ",".join(map(str, args.rates))]
        results[path] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    report(results, versions, args)
    return 0 if all(r["exact"] for r in results.values()) else 1


def report(results: dict, versions: list, args) -> None:
    staged, inplace = results["staged"], results["inplace"]
    mb = 1e6
    print(f"\nmodel {staged['model_bytes'] / 1e9:.2f} GB on {args.device}; both paths exact at the last version: "
          f"{staged['exact'] and inplace['exact']}")
    print("| version | changed | frames MB | staged s | in place s | in place / staged | staged host MB | "
          "in place host MB | in place host / frames |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for s, i in zip(staged["versions"], inplace["versions"]):
        if s["rate"] == 0:
            continue
        rows.append((s, i))
        print(f"| {s['version']} | {s['rate']:.1%} | {s['frame_bytes'] / mb:.2f} | {s['seconds']:.3f} | "
              f"{i['seconds']:.3f} | {i['seconds'] / s['seconds']:.3f} | {s['held_bytes'] / mb:.0f} | "
              f"{i['held_bytes'] / mb:.1f} | {i['held_bytes'] / s['frame_bytes']:.2f} |")
    if len(rows) >= 2:
        lo, hi = rows[0][1], rows[-1][1]
        print(f"in place: the {lo['rate']:.1%} version takes {lo['seconds'] / hi['seconds']:.3f}x the "
              f"{hi['rate']:.1%} version's time (target: at most 0.2)")
    gb = inplace["model_bytes"] / 1e9
    print(f"recheck (a digest pass over the bits, before each update by default): in place "
          f"{inplace['recheck_seconds']:.3f} s ({gb / inplace['recheck_seconds']:.1f} GB/s), staged host mirror "
          f"{staged['recheck_seconds']:.3f} s ({gb / staged['recheck_seconds']:.1f} GB/s)")
    if "d2d_copy_seconds" in inplace:
        d2d = inplace["model_bytes"] / inplace["d2d_copy_seconds"] / 1e9
        for _, i in rows:
            print(f"in place {i['rate']:.1%}: {inplace['model_bytes'] / i['seconds'] / 1e9:.1f} GB/s of model "
                  f"against the device's copy at {d2d:.1f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        rates = [100 * s["rate"] for s, _ in rows]
        ax[0].plot(rates, [s["seconds"] for s, _ in rows], "o-", label="staged (mirror + copy back)")
        ax[0].plot(rates, [i["seconds"] for _, i in rows], "o-", label="in place")
        ax[0].set(xlabel="% of elements changed", ylabel="seconds per version", title="apply time")
        ax[1].plot(rates, [s["held_bytes"] / mb for s, _ in rows], "o-", label="staged")
        ax[1].plot(rates, [i["held_bytes"] / mb for _, i in rows], "o-", label="in place")
        ax[1].plot(rates, [2 * s["frame_bytes"] / mb for s, _ in rows], "k--", label="2x the frames")
        ax[1].set(xlabel="% of elements changed", ylabel="host MB held", yscale="log", title="host memory")
        for a in ax:
            a.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
