"""Machine-readable results of the failure campaigns (test_refit.py, and the
relay and S3 campaigns of test_soak_campaigns.py), for scripts/soak.sh.

When DCR_CAMPAIGN_REPORT names a file, each campaign appends one JSON line
per episode and one at its end (or at its failure) to it:

  {"record": "episode", "campaign": "refit", "seed": S, "episode": n, "version": v,
   "kind": "...", "faults": {"kind": count, ...}, "receivers_checked": k,
   "committed": true, "attempt": "...", "reruns": r, "seconds": t, "detail": "..."}
  {"record": "failure", "campaign": ..., "seed": S, "episode": n, "kind": ...,
   "class": "divergence" | "double-commit" | "hang" | "error", "message": "...",
   "replay": "VAR=... pytest ..."}
  {"record": "end", "campaign": ..., "seed": S, "episodes": n, "counters": {...}}

Without the variable nothing is written. Standard library only.
"""

from __future__ import annotations

import json
import os
import time

# What a failure message says, first match wins: the classes the soak counts.
_CLASSES = [
    ("double-commit", ("commit record of version", "exactly one coordinator", "committed attempts",
                       "changed:", "two commits")),
    ("divergence", ("differs from", "differ from", ": files [", "committed with digest")),
    ("hang", ("hung", "did not reach version", "time bound", "did not register", "did not finish",
              "timed out", "timeoutexpired")),
]


def classify(exc: BaseException) -> str:
    return classify_text(f"{type(exc).__name__}: {exc}")


def classify_text(message: str) -> str:
    # The headline, and the violations listed under "invariants broken"; not
    # the logs and states quoted below them (indented), which may say anything.
    lines = message.splitlines() or [""]
    text = "\n".join([lines[0]] + [x for x in lines[1:] if x and not x[0].isspace()
                                    and not x.startswith(("receiver ", "publish "))]).lower()
    for name, needles in _CLASSES:
        if any(n.lower() in text for n in needles):
            return name
    return "error"


class CampaignReport:
    def __init__(self, campaign: str, seed: int, replay: str):
        self.campaign, self.seed, self.replay = campaign, seed, replay
        self.path = os.environ.get("DCR_CAMPAIGN_REPORT") or None

    def _write(self, doc: dict) -> None:
        if not self.path:
            return
        doc = {"record": doc.pop("record"), "campaign": self.campaign, "seed": self.seed, "time": round(time.time(), 3),
               **doc}
        with open(self.path, "a") as f:
            f.write(json.dumps(doc, sort_keys=False) + "\n")

    def episode(self, **fields) -> None:
        self._write({"record": "episode", **fields})

    def failure(self, episode: int | None, kind: str | None, exc: BaseException) -> str:
        cls = classify(exc)
        self._write({"record": "failure", "episode": episode, "kind": kind, "class": cls,
                     "message": f"{type(exc).__name__}: {exc}"[:4000], "replay": self.replay})
        return cls

    def end(self, episodes: int, counters: dict) -> None:
        self._write({"record": "end", "episodes": episodes, "counters": counters})


# ---------------------------------------------------------------- the soak's summary

def summarize(lines: list[dict], meta: dict) -> tuple[dict, str]:
    """Adds up report lines: the summary (JSON) and its markdown."""
    by_kind: dict[tuple[str, str], dict] = {}
    campaigns: dict[str, dict] = {}
    failures = []
    seeds: dict[str, list[int]] = {}
    for r in lines:
        c = r.get("campaign", "?")
        camp = campaigns.setdefault(c, {"batches": 0, "episodes": 0, "faults": 0, "receivers_checked": 0,
                                        "versions_committed": 0, "failed_batches": 0})
        if r["record"] == "episode":
            k = by_kind.setdefault((c, r["kind"]), {"campaign": c, "kind": r["kind"], "episodes": 0, "faults": {},
                                                    "receivers_checked": 0, "versions_committed": 0, "reruns": 0,
                                                    "seconds": 0.0})
            k["episodes"] += 1
            for name, n in (r.get("faults") or {}).items():
                k["faults"][name] = k["faults"].get(name, 0) + n
            k["receivers_checked"] += r.get("receivers_checked", 0)
            k["versions_committed"] += 1 if r.get("committed") else 0
            k["reruns"] += r.get("reruns", 0)
            k["seconds"] += r.get("seconds", 0.0)
            camp["episodes"] += 1
            camp["faults"] += sum((r.get("faults") or {}).values())
            camp["receivers_checked"] += r.get("receivers_checked", 0)
            camp["versions_committed"] += 1 if r.get("committed") else 0
            if r.get("seed") not in seeds.setdefault(c, []):
                seeds[c].append(r.get("seed"))
        elif r["record"] == "end":
            camp["batches"] += 1
            camp["receivers_checked"] += r["counters"].get("final_receivers_checked", 0)
            camp["versions_committed"] += 1  # version 0, published before the faults
        elif r["record"] == "failure":
            if r.get("kind") is not None:  # a campaign's (not the soak's own): classed with today's rules
                r = dict(r, **{"class": classify_text(r.get("message") or "")})
            camp["batches"] += 1
            camp["failed_batches"] += 1
            failures.append({k: r.get(k) for k in ("campaign", "seed", "episode", "kind", "class", "message", "replay")})
    classes = [f["class"] for f in failures]
    totals = {
        "episodes": sum(c["episodes"] for c in campaigns.values()),
        "faults": sum(c["faults"] for c in campaigns.values()),
        "receivers_checked": sum(c["receivers_checked"] for c in campaigns.values()),
        "versions_committed": sum(c["versions_committed"] for c in campaigns.values()),
        "batches": sum(c["batches"] for c in campaigns.values()),
        "divergences": classes.count("divergence"),
        "double_commits": classes.count("double-commit"),
        "hangs": classes.count("hang"),
        "errors": classes.count("error"),
    }
    summary = {"meta": meta, "totals": totals, "campaigns": campaigns,
               "kinds": sorted(by_kind.values(), key=lambda k: (k["campaign"], k["kind"])),
               "seeds": seeds, "failures": failures}
    secs = float(meta.get("seconds", 0) or 0)
    md = ["# Soak summary", ""]
    md += [f"- {k}: {v}" for k, v in meta.items()]
    if secs:
        md.append(f"- rate: {totals['episodes'] / (secs / 60):.1f} episodes/min")
    md += ["", "| episodes | faults | receivers checked | versions committed | divergences | double commits | hangs "
           "| other failures |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
           f"| {totals['episodes']} | {totals['faults']} | {totals['receivers_checked']} | "
           f"{totals['versions_committed']} | {totals['divergences']} | {totals['double_commits']} | "
           f"{totals['hangs']} | {totals['errors']} |", "",
           "| campaign | kind | episodes | faults injected | receivers checked | versions committed | clean re-runs |",
           "|---|---|---:|---|---:|---:|---:|"]
    for k in summary["kinds"]:
        faults = ", ".join(f"{n} {name}" for name, n in sorted(k["faults"].items())) or "0 (the fault did not land)"
        md.append(f"| {k['campaign']} | {k['kind']} | {k['episodes']} | {faults} | {k['receivers_checked']} | "
                  f"{k['versions_committed']} | {k['reruns']} |")
    md += ["", "| campaign | batches | failed | episodes | faults | receivers checked | versions committed |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in sorted(campaigns.items()):
        md.append(f"| {name} | {c['batches']} | {c['failed_batches']} | {c['episodes']} | {c['faults']} | "
                  f"{c['receivers_checked']} | {c['versions_committed']} |")
    md += ["", "Receivers checked: each episode compares every receiver with a dense copy of the version it "
           "committed, byte for byte; each batch ends with a fresh follower and `dcr diff` of every receiver "
           "(refit, s3). Versions committed include each batch's version 0. Faults: one per episode for process, "
           "relay and frame faults; for the s3:* kinds, each injected HTTP fault.", ""]
    md.append("Seeds (DCR_CAMPAIGN_SEED) by campaign: " +
              "; ".join(f"{c}: {' '.join(str(s) for s in ss)}" for c, ss in sorted(seeds.items())))
    if failures:
        md += ["", "## Failures", ""]
        for f in failures:
            md += [f"- **{f['class']}** in {f['campaign']} episode {f['episode']} ({f['kind']}), seed {f['seed']}:",
                   f"  replay: `{f['replay']}`", "", "  ```", *("  " + line for line in
                                                             (f["message"] or "").splitlines()[:20]), "  ```"]
    return summary, "\n".join(md) + "\n"


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="scripts/soak.sh's helper: summaries and failure records")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("report")
    s.add_argument("--out", required=True)
    s.add_argument("--meta", action="append", default=[])
    h = sub.add_parser("record-hang")
    h.add_argument("report")
    h.add_argument("--campaign", required=True)
    h.add_argument("--seed", type=int, required=True)
    h.add_argument("--message", required=True)
    h.add_argument("--replay", required=True)
    h.add_argument("--class", dest="cls", default="hang")
    lf = sub.add_parser("last-failure")
    lf.add_argument("report")
    a = ap.parse_args(argv)
    if a.cmd == "last-failure":
        with open(a.report) as f:
            last = [json.loads(x) for x in f if '"record": "failure"' in x][-1:]
        if not last:
            return 1
        r = last[0]
        print(f"soak: {r['class']} in {r['campaign']} episode {r['episode']} ({r['kind']}), seed {r['seed']}:")
        print("\n".join("  " + x for x in (r["message"] or "").splitlines()[:12]))
        print(f"soak: replay: {r['replay']}")
        return 0
    if a.cmd == "record-hang":
        with open(a.report, "a") as f:
            f.write(json.dumps({"record": "failure", "campaign": a.campaign, "seed": a.seed, "time": round(time.time(), 3),
                                "episode": None, "kind": None, "class": a.cls, "message": a.message,
                                "replay": a.replay}) + "\n")
        return 0
    lines = []
    with open(a.report) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by a kill
    meta = dict(m.split("=", 1) for m in a.meta)
    summary, md = summarize(lines, meta)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
