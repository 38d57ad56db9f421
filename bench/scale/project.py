#!/usr/bin/env python3
"""Project refit times on the reference testbed with the scale model (model.py),
its parameters as validate.py measured them on this machine (validation.json), and
plot: the validation (measured against predicted), time against nodes, time against
model size, next to the reference design's published figures.

  bench/scale/project.py [--validation docs/scale/validation.json] [--out docs/scale]

Prints the projection table as Markdown (docs/scale.md holds it).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model import Config, Params, predict  # noqa: E402

GB = 1e9
# The reference testbed (REFERENCE.md): 8 trainer and 8 rollout nodes, at most
# 5 Gbit/s of cross-cluster flow per node.
NODES = 8
CROSS = 5e9 / 8
# Assumed where the reference is silent (docs/scale.md, "Assumptions").
IN_LINK = 100e9 / 8        # in-cluster: 100 Gbit/s per node
CORES = 32                 # cores per node given to dcr (publishing; applying)
FANOUT = 2
PER_RELAY = 1              # one engine (rollout node) per relay: a relay on each node
SEGMENT = 16 << 20         # the default segment size for checkpoints above 64 GB
S3_REQUEST = 0.030         # seconds per S3 request (first byte), where the store is S3
# Bytes a receiver downloads per changed element (docs/benchmarks.md, training
# model; download / payload 1.003 at 2 GB), by change rate.
BYTES_PER_CHANGED = {0.01: 1.313 * 1.003, 0.03: 1.124 * 1.003, 0.05: 1.032 * 1.003}
# The CPU rates are measured at 3% (validate.py); at 1% and 5% they scale as the
# codec's single-core rates do (docs/benchmarks.md, "Delta codec", training model).
ENCODE_SCALE = {0.01: 5.02 / 4.21, 0.03: 1.0, 0.05: 3.03 / 4.21}
APPLY_SCALE = {0.01: 10.01 / 5.11, 0.03: 1.0, 0.05: 3.98 / 5.11}
MODELS = {"30B": 61.8e9, "120B": 247.2e9, "235B": 470e9, "480B": 960e9, "1T": 2242e9}
# The reference's published refit times (seconds), relay tree / S3.
REFERENCE = {("120B", 0.03): "relay 22.6, S3 24.5 (open impl.: S3 20.2, relay 24.1)",
             ("120B", 0.05): "relay 41.6, S3 49.7", ("1T", 0.03): "relay 150"}


def testbed(dense: float, rate: float, nodes: int = NODES, **kw) -> Config:
    payload = dense / 2 * rate * BYTES_PER_CHANGED[rate]
    c = Config(dense=dense, payload=payload, trainers=nodes, receivers=nodes, cross_link=CROSS, in_link=IN_LINK,
               fanout=FANOUT, per_relay=PER_RELAY, segment=SEGMENT, trainer_cores=CORES, rollout_cores=CORES)
    return replace(c, **{"store": "s3", **kw})


def at_rate(p: Params, rate: float) -> Params:
    return replace(p, encode_rate=p.encode_rate * ENCODE_SCALE[rate], apply_rate=p.apply_rate * APPLY_SCALE[rate])


def save_log_log(fig, ax, path: Path, xlabel: str, ylabel: str, xbase: int = 10) -> None:
    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--validation", default="docs/scale/validation.json")
    ap.add_argument("--out", default="docs/scale")
    a = ap.parse_args()
    v = json.loads(Path(a.validation).read_text())
    p = Params(**{k: float(x) for k, x in v["params"].items()})
    # Trainer processes that keep their publisher open between steps (the Python
    # ShardPublisher, the vLLM trainer engine) start nothing per version; the store's
    # requests take S3's time.
    p = replace(p, process_cpu=0.0, s3_request_seconds=S3_REQUEST)
    out = Path(a.out)

    print("| model | changed | via | payload | predicted | bound | stages (s) | reference |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("120B", "1T"):
        for rate in (0.01, 0.03, 0.05):
            for via in ("relay", "s3"):
                c = testbed(MODELS[name], rate, transport=via, store="s3")
                r = predict(c, at_rate(p, rate))
                stages = ", ".join(f"{k} {s:.2f}" for k, s in sorted(r.stages.items(), key=lambda kv: -kv[1]))
                fixed = p.latency + p.s3_latency + p.peer_poll + 6 * p.s3_request_seconds
                print(f"| {name} | {rate:.0%} | {via} | {c.payload / GB:.2f} GB | {r.seconds:.1f} s | {r.bound} | "
                      f"{stages}; fill {r.fill:.2f}, fixed {fixed:.2f} | {REFERENCE.get((name, rate), '')} |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Validation: measured against predicted.
    fig, ax = plt.subplots(figsize=(5, 5))
    xs = [r["measured"] for r in v["results"]]
    ys = [r["predicted"] for r in v["results"]]
    hi = max(xs + ys) * 1.1
    ax.plot([0, hi], [0, hi], color="gray", lw=1)
    ax.fill_between([0, hi], [0, hi * 0.8], [0, hi * 1.2], color="gray", alpha=0.15, label="within 20%")
    for r, x, y in zip(v["results"], xs, ys):
        c = r["config"]
        ax.scatter(x, y, color={"cross": "C0", "tree": "C1", "cpu": "C2", "receive": "C3"}.get(r["bound"], "C4"))
        ax.annotate(f"P{c['trainers']} R{c['receivers']}", (x, y), fontsize=7, xytext=(3, -8),
                    textcoords="offset points")
    ax.set_xlabel("measured refit (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title(f"scale model against real runs ({v['size']} model, {v['cores']} cores, tc tbf links)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "validation.png", dpi=120)

    # Time against nodes (P = R), 120B and 1T at 3%.
    fig, ax = plt.subplots(figsize=(6, 4))
    nodes = [1, 2, 4, 8, 16, 32, 64]
    for name, color in (("120B", "C0"), ("1T", "C1")):
        ts = [predict(testbed(MODELS[name], 0.03, nodes=n), at_rate(p, 0.03)).seconds for n in nodes]
        ax.plot(nodes, ts, marker="o", color=color, label=f"{name}, 3%")
    ax.scatter([8], [22.6], marker="x", color="C0", label="reference 120B (relay)")
    ax.scatter([8], [150], marker="x", color="C1", label="reference 1T (relay)")
    save_log_log(fig, ax, out / "nodes.png", "trainer nodes = rollout nodes (5 Gbit/s cross-cluster each)",
                 "refit (s)", xbase=2)

    # Time against model size on the testbed, at 1, 3 and 5%.
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = sorted(MODELS.values())
    for rate, color in ((0.01, "C2"), (0.03, "C0"), (0.05, "C3")):
        ts = [predict(testbed(s, rate), at_rate(p, rate)).seconds for s in sizes]
        ax.plot([s / GB for s in sizes], ts, marker="o", color=color, label=f"dcr {rate:.0%}")
    ax.scatter([247.2, 2242], [22.6, 150], marker="x", color="C0", label="reference 3% (relay)")
    ax.scatter([247.2], [41.6], marker="x", color="C3", label="reference 5% (relay)")
    save_log_log(fig, ax, out / "sizes.png", "checkpoint (GB, BF16)", "refit (s), 8 + 8 nodes")
    print(f"\nplots: {out / 'validation.png'}, {out / 'nodes.png'}, {out / 'sizes.png'}")


if __name__ == "__main__":
    main()
