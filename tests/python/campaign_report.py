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


class CampaignSettings:
    """A campaign's settings from the environment: its episode count
    (``count_var``; default one round, each kind once), DCR_CAMPAIGN_SEED
    (default random), DCR_CAMPAIGN_KINDS (a subset of ``kinds``) and
    DCR_CAMPAIGN_TIME_BOUND_S (default ``bound(episodes)``); ``replay`` is
    the command that runs the same episodes again, and ``report`` its
    CampaignReport."""

    def __init__(self, name: str, count_var: str, kinds: list, bound, test: str):
        import random

        given = os.environ.get("DCR_CAMPAIGN_KINDS")
        self.kinds = given.split(",") if given else list(kinds)
        unknown = set(self.kinds) - set(kinds)
        if unknown:
            raise ValueError(f"unknown kinds: {sorted(unknown)}")
        self.episodes = int(os.environ.get(count_var) or len(self.kinds))
        seed = os.environ.get("DCR_CAMPAIGN_SEED")
        self.seed = int(seed) if seed else random.SystemRandom().randrange(1, 1 << 31)
        self.bound = float(os.environ.get("DCR_CAMPAIGN_TIME_BOUND_S") or bound(self.episodes))
        self.replay = (f"DCR_CAMPAIGN_SEED={self.seed} {count_var}={self.episodes}"
                       + (f" DCR_CAMPAIGN_KINDS={','.join(self.kinds)}" if given else "")
                       + f" .venv/bin/python -m pytest -s {test}")
        self.report = CampaignReport(name, self.seed, self.replay)
        print(f"\n{name} failure campaign: DCR_CAMPAIGN_SEED={self.seed} {count_var}={self.episodes} "
              f"(time bound {self.bound:.0f} s)", flush=True)


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


# ---- The ledger (tests/soak/ledger.tsv): one row per batch, kept in the repo
# like the fuzz ledger, so that the soak record adds up across runs and
# machines (`scripts/soak.sh --totals`).

LEDGER_COLUMNS = ["date", "commit", "campaign", "seed", "seconds", "episodes", "faults", "receivers_checked",
                  "versions_committed", "divergences", "double_commits", "hangs", "other_failures"]
_COUNTS = LEDGER_COLUMNS[4:]


def ledger_row(lines: list[dict], campaign: str, seed: int, commit: str, seconds: float | None = None) -> dict:
    """The ledger row of one batch: the records of `campaign` with `seed`."""
    mine = [r for r in lines if r.get("campaign") == campaign and r.get("seed") == seed]
    if not mine:
        raise ValueError(f"no records of campaign {campaign} with seed {seed}")
    t = summarize(mine, {})[0]["totals"]
    if seconds is None:  # from the records: the first episode's start to the last record
        times = [r["time"] for r in mine if "time" in r]
        first = min((r for r in mine if "time" in r), key=lambda r: r["time"])
        seconds = max(times) - min(times) + first.get("seconds", 0.0)
    day = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(min(r.get("time", time.time()) for r in mine)))
    return {"date": day, "commit": commit, "campaign": campaign, "seed": seed, "seconds": int(round(seconds)),
            "episodes": t["episodes"], "faults": t["faults"], "receivers_checked": t["receivers_checked"],
            "versions_committed": t["versions_committed"], "divergences": t["divergences"],
            "double_commits": t["double_commits"], "hangs": t["hangs"], "other_failures": t["errors"]}


def read_ledger(path: str) -> list[dict]:
    """The ledger's rows (counts as ints); [] when it does not exist."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        if header != LEDGER_COLUMNS:
            raise ValueError(f"{path}: not a soak ledger (columns {header})")
        rows = []
        for n, line in enumerate(f, start=2):
            cells = line.rstrip("\n").split("\t")
            if len(cells) != len(LEDGER_COLUMNS):
                raise ValueError(f"{path}:{n}: {len(cells)} cells, not {len(LEDGER_COLUMNS)}")
            row = dict(zip(LEDGER_COLUMNS, cells))
            for k in _COUNTS:
                row[k] = int(row[k])
            rows.append(row)
        return rows


def append_ledger(path: str, row: dict) -> None:
    """Appends `row`; a batch already in the ledger (campaign and seed) is not counted twice."""
    rows = read_ledger(path)
    if any(r["campaign"] == row["campaign"] and r["seed"] == str(row["seed"]) for r in rows):
        return
    new = not rows and not os.path.exists(path)
    with open(path, "a") as f:
        if new:
            f.write("\t".join(LEDGER_COLUMNS) + "\n")
        f.write("\t".join(str(row[k]) for k in LEDGER_COLUMNS) + "\n")


def ledger_totals(rows: list[dict]) -> tuple[dict, str]:
    """Sums over the ledger, overall and by campaign, and a Markdown table."""
    def add(into: dict, r: dict) -> None:
        for k in _COUNTS:
            into[k] = into.get(k, 0) + r[k]
        into["batches"] = into.get("batches", 0) + 1

    total: dict = {}
    by: dict = {}
    for r in rows:
        add(total, r)
        add(by.setdefault(r["campaign"], {}), r)
    head = ("| campaign | batches | minutes | episodes | faults | receivers checked | versions committed | "
            "divergences | double commits | hangs | other failures |")
    md = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, t in sorted(by.items()) + [("**total**", total)]:
        if not t:
            continue
        md.append(f"| {name} | {t['batches']} | {t['seconds'] / 60:.0f} | {t['episodes']:,} | {t['faults']:,} | "
                  f"{t['receivers_checked']:,} | {t['versions_committed']:,} | {t['divergences']} | "
                  f"{t['double_commits']} | {t['hangs']} | {t['other_failures']} |")
    return {"total": total, "campaigns": by}, "\n".join(md) + "\n"


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
    la = sub.add_parser("ledger-append", help="append each named batch of REPORT to the ledger")
    la.add_argument("report")
    la.add_argument("--ledger", required=True)
    la.add_argument("--commit", required=True)
    la.add_argument("--batch", action="append", default=[], metavar="CAMPAIGN:SEED")
    la.add_argument("--seconds", type=float, help="the batch's wall time (one --batch; default: from its records)")
    lt = sub.add_parser("ledger-totals")
    lt.add_argument("ledger")
    lt.add_argument("--field", help="print only this total (e.g. faults)")
    a = ap.parse_args(argv)
    if a.cmd == "ledger-totals":
        totals, md = ledger_totals(read_ledger(a.ledger))
        print(totals["total"].get(a.field, 0) if a.field else md, end="\n" if a.field else "")
        return 0
    if a.cmd == "ledger-append":
        with open(a.report) as f:
            lines = [json.loads(x) for x in f if x.strip().startswith("{") and x.strip().endswith("}")]
        for b in a.batch:
            campaign, seed = b.rsplit(":", 1)
            row = ledger_row(lines, campaign, int(seed), a.commit, a.seconds)
            append_ledger(a.ledger, row)
            print(f"ledger: {campaign} seed {seed}: {row['episodes']} episodes, {row['faults']} faults")
        return 0
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
