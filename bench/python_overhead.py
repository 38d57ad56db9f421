#!/usr/bin/env python3
"""What the Python package adds to the C++ path's time for the same refit.

Data: a ``dcr gen`` qwen3-moe-like pair (v0 -> v1, training update model,
``--size`` 300MB, ``--rate`` 3% by default). The same refit, in the same run:

  in memory, over live buffers (the trainer and engine side):
    C++   build/bench/dcr_refit_api_bench: the calls Sender.make_delta and
          Receiver.apply make, from C++ on std::vector buffers;
    Python dcr.Sender / dcr.Receiver over torch tensors (copies of v0 / v1 in
          memory), make_delta then apply.
  over files (a delta directory between checkpoints):
    C++   ``dcr delta make`` and ``dcr delta apply`` (the CLI's own timings,
          without process start-up);
    Python dcr.make_delta / dcr.apply_delta (the same C++ functions).

Every timing is the best of ``--reps`` (3); the engine is restored to v0
between runs (untimed). The ratio Python / C++ is printed for each path.

  .venv/bin/python bench/python_overhead.py [--size 300MB] [--rate 0.03] [--reps 3] [--dir /tmp/dcr-bench-py]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import dcr

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("DCR_BUILD", ROOT / "build"))


def run_json(args) -> dict:
    out = subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def best(reps: int, fn, reset=None) -> float:
    t = float("inf")
    for _ in range(reps):
        if reset:
            reset()
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="300MB")
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", default="xor", choices=["xor", "overwrite"])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dcr-bench-py"))
    a = ap.parse_args()
    dcr_exe, api_bench = BUILD / "tools/dcr/dcr", BUILD / "bench/dcr_refit_api_bench"
    for exe in (dcr_exe, api_bench):
        if not exe.is_file():
            raise SystemExit(f"python_overhead: {exe} missing (cmake --build build --target dcr dcr_refit_api_bench)")

    data = a.dir / f"qwen3-moe-{a.size}-training-{a.rate}"
    if not (data / "gen.json").is_file():
        shutil.rmtree(data, ignore_errors=True)
        subprocess.run([dcr_exe, "gen", "--family", "qwen3-moe", "--size", a.size, "--versions", "1", "--update",
                        "training", "--rate", str(a.rate), "--seed", "1", "-o", data], check=True,
                       stdout=subprocess.DEVNULL)
    v0, v1 = data / "v0", data / "v1"
    print(f"data: {data} (dcr gen qwen3-moe, training model, rate {a.rate:g}); {a.mode} class; best of {a.reps}")
    print(f"machine: {os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    # ---- in memory, over live buffers
    cc = run_json([api_bench, v0, v1, "--reps", a.reps, "--mode", a.mode])
    c0, c1 = dcr.Checkpoint.open(v0), dcr.Checkpoint.open(v1)
    names = c0.names()
    live = {n: c0.tensor(n).clone() for n in names}
    nxt = {n: c1.tensor(n).clone() for n in names}
    engine = {n: c0.tensor(n).clone() for n in names}
    sender = dcr.Sender(live)  # baseline := v0
    for n in names:
        live[n].copy_(nxt[n])  # the optimizer step
    receiver = dcr.Receiver(engine)
    deltas = []

    def make():
        deltas.append(sender.make_delta(mode=a.mode))

    def restore():
        for n in names:
            engine[n].copy_(c0.tensor(n))

    py_make = best(a.reps, make)
    delta = deltas[-1]
    py_apply = best(a.reps, lambda: receiver.apply(delta), restore)
    if receiver.digest() != delta.target_digest or any(not torch.equal(engine[n].view(torch.uint8).flatten(),
                                                                       nxt[n].view(torch.uint8).flatten())
                                                       for n in names):
        raise SystemExit("python_overhead: the Python apply did not reach v1")
    if delta.changed_words != cc["changed_words"]:
        raise SystemExit(f"python_overhead: C++ and Python deltas differ ({cc['changed_words']} vs "
                         f"{delta.changed_words} changed words)")
    del live, nxt, engine, sender, receiver, deltas, delta

    # ---- over files
    work = a.dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    target = work / "target"

    def fresh_target():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(v0, target)

    def cli_make():
        shutil.rmtree(work / "d-cli", ignore_errors=True)
        return run_json([dcr_exe, "delta", "make", v0, v1, "-o", work / "d-cli", "--mode", a.mode, "--json"])["seconds"]

    def cli_apply():
        fresh_target()
        return run_json([dcr_exe, "delta", "apply", target, work / "d-cli", "--json"])["seconds"]

    cli_m = min(cli_make() for _ in range(a.reps))
    cli_a = min(cli_apply() for _ in range(a.reps))
    py_fm = best(a.reps, lambda: dcr.make_delta(v0, v1, work / "d-py", mode=a.mode),
                 lambda: shutil.rmtree(work / "d-py", ignore_errors=True))
    py_fa = best(a.reps, lambda: dcr.apply_delta(target, work / "d-py"), fresh_target)
    if not dcr.verify_delta(target, work / "d-py").matches:
        raise SystemExit("python_overhead: the Python file apply did not reach v1")
    shutil.rmtree(work)

    gb = cc["bytes"] / 1e9
    print(f"\n{cc['bytes'] / 1e6:.0f} MB, {cc['changed_words']} changed words, frames {cc['frame_bytes'] / 1e6:.2f} MB")
    print(f"{'':<34} {'C++ s':>8} {'Python s':>9} {'Python / C++':>13}")
    rows = [("in memory: make (Sender.make_delta)", cc["make_s"], py_make),
            ("in memory: apply (Receiver.apply)", cc["apply_s"], py_apply),
            ("in memory: make + apply", cc["make_s"] + cc["apply_s"], py_make + py_apply),
            ("files: delta make", cli_m, py_fm), ("files: delta apply", cli_a, py_fa),
            ("files: make + apply", cli_m + cli_a, py_fm + py_fa)]
    for label, c, p in rows:
        print(f"{label:<34} {c:>8.4f} {p:>9.4f} {p / c:>12.3f}x")
    refit = (py_make + py_apply) / (cc["make_s"] + cc["apply_s"])
    print(f"\nPython adds {100 * (refit - 1):+.1f}% to the C++ in-memory refit "
          f"({gb / (cc['make_s'] + cc['apply_s']):.2f} GB/s in C++, {gb / (py_make + py_apply):.2f} GB/s in Python); "
          f"{100 * ((py_fm + py_fa) / (cli_m + cli_a) - 1):+.1f}% over files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
