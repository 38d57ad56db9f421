"""A version's timeline as a picture: ``python -m dcr.timeline TRACE.json OUT.png``.

``dcr status --store URL --timeline V --out TRACE.json`` gathers committed
version V's timeline from the store (docs/metrics.md, "Timeline"): every
publishing process's stages (its timeline record) and every receiver's
(the spans of its ack), as a Chrome / Perfetto trace. This draws it with
matplotlib: one row per process, each stage a bar in its colour, the
commit a vertical line, and the title says how much of the publish call the
publisher's stages cover.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# Stages in the order of the walk a version takes, each with its colour.
STAGE_COLOURS = {
    "prepare": "#bbbbbb", "baseline": "#8c564b", "staging": "#e377c2", "open": "#7f7f7f",
    "encode": "#1f77b4", "ack_wait": "#c7c7c7", "commit": "#d62728", "advance": "#9467bd",
    "snapshot": "#17becf", "gc": "#dbdb8d", "download": "#ff7f0e", "apply": "#2ca02c", "ack": "#000000",
    "join": "#bcbd22",
}
# Stages that overlap others of the same process (drawn thinner, behind).
BACKGROUND = {"staging", "download", "ack_wait"}


def read_trace(path: str) -> dict[str, Any]:
    """The trace's rows: {"rows": [(label, [(stage, start_s, dur_s)])], "commit_s", "version", "publish_seconds"}."""
    with open(path) as f:
        doc = json.load(f)
    other = doc.get("otherData", {})
    if other.get("format") != "dcr-timeline-trace":
        raise ValueError(f"{path}: not a dcr timeline trace (dcr status --timeline V --out FILE writes one)")
    names: dict[int, str] = {}
    rows: dict[int, list] = {}
    commit_s = None
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e.get("name") == "commit" and e.get("ph") == "i" and e.get("s") == "g":
            commit_s = e["ts"] / 1e6
        elif e.get("ph") in ("X", "i"):
            rows.setdefault(e["pid"], []).append((e["name"], e["ts"] / 1e6, e.get("dur", 0) / 1e6))
    return {"rows": [(names.get(pid, f"process {pid}"), rows.get(pid, [])) for pid in sorted(names)],
            "commit_s": commit_s, "version": other.get("version"), "attempt": other.get("attempt"),
            "publish_seconds": other.get("publish_seconds", 0.0)}


def publisher_coverage(trace: dict[str, Any]) -> float:
    """The committing publisher's stages (staging, which overlaps them, aside) over its publish call's seconds."""
    total = trace["publish_seconds"]
    for label, spans in trace["rows"]:
        if label.startswith("publisher ") and "(attempt" not in label:
            return sum(d for stage, _, d in spans if stage != "staging") / total if total else 0.0
    return 0.0


def draw(trace: dict[str, Any], out_png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = trace["rows"]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(rows)))
    seen = set()
    for y, (label, spans) in enumerate(rows):
        for stage, start, dur in spans:
            colour = STAGE_COLOURS.get(stage, "#333333")
            lab = stage if stage not in seen else None
            seen.add(stage)
            if dur <= 0:
                ax.plot([start], [y], marker="v", color=colour, markersize=8, label=lab, linestyle="none")
            elif stage in BACKGROUND:
                ax.broken_barh([(start, dur)], (y - 0.15, 0.3), facecolors=colour, alpha=0.6, label=lab)
            else:
                ax.broken_barh([(start, dur)], (y - 0.35, 0.7), facecolors=colour, label=lab)
    if trace["commit_s"] is not None:
        ax.axvline(trace["commit_s"], color="#d62728", linestyle="--", linewidth=1)
        ax.text(trace["commit_s"], len(rows) - 0.4, " commit", color="#d62728", va="bottom")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the first stage (each process's own clock)")
    ax.set_title(f"dcr version {trace['version']} (attempt {trace['attempt']}): publish "
                 f"{trace['publish_seconds']:.3f} s, its stages cover {publisher_coverage(trace):.0%} of it")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a trace from dcr status --timeline V --out TRACE.json")
    p.add_argument("png", help="the picture to write")
    a = p.parse_args(argv)
    try:
        trace = read_trace(a.trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"dcr.timeline: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("dcr.timeline: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    draw(trace, a.png)
    print(f"wrote {a.png}: {len(trace['rows'])} processes; the publisher's stages cover "
          f"{publisher_coverage(trace):.1%} of its publish call ({trace['publish_seconds']:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
