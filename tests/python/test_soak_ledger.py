"""The soak ledger (tests/soak/ledger.tsv, campaign_report.py): one row per
batch from the campaigns' records, a batch never counted twice, sums by
campaign, and a file that is not a ledger refused."""

from __future__ import annotations

import os

import pytest

import campaign_report as cr

LEDGER = os.path.join(os.path.dirname(__file__), "..", "soak", "ledger.tsv")


def records(campaign: str, seed: int, faults: list, failure: str | None = None) -> list:
    out = [{"record": "episode", "campaign": campaign, "seed": seed, "time": 100.0 + i, "episode": i, "kind": "k",
            "faults": {"k": n}, "receivers_checked": 3, "committed": True, "seconds": 2.0}
           for i, n in enumerate(faults)]
    if failure:
        out.append({"record": "failure", "campaign": campaign, "seed": seed, "time": 200.0, "episode": len(faults),
                    "kind": "k", "message": failure, "replay": "x"})
    else:
        out.append({"record": "end", "campaign": campaign, "seed": seed, "time": 150.0, "episodes": len(faults),
                    "counters": {"final_receivers_checked": 3}})
    return out


def test_batches_add_up_once_each(tmp_path):
    lines = records("refit", 7, [1, 1, 0]) + records("s3", 8, [5, 2], failure="receiver r1 differs from the dense copy")
    ledger = str(tmp_path / "ledger.tsv")
    for campaign, seed in (("refit", 7), ("s3", 8), ("refit", 7)):  # the last again: not counted twice
        cr.append_ledger(ledger, cr.ledger_row(lines, campaign, seed, "abc123"))
    rows = cr.read_ledger(ledger)
    assert [(r["campaign"], r["seed"], r["episodes"], r["faults"]) for r in rows] == [("refit", "7", 3, 2),
                                                                                        ("s3", "8", 2, 7)]
    assert rows[0]["receivers_checked"] == 12 and rows[0]["versions_committed"] == 4  # + the final check, version 0
    assert rows[0]["seconds"] == 52  # first episode's start (100 - 2) to the end record (150)
    assert rows[1]["divergences"] == 1 and rows[1]["other_failures"] == 0
    totals, md = cr.ledger_totals(rows)
    assert totals["total"]["faults"] == 9 and totals["total"]["batches"] == 2 and totals["total"]["divergences"] == 1
    assert "| **total** | 2 |" in md and "| s3 | 1 |" in md
    with pytest.raises(ValueError, match="no records of campaign relay"):
        cr.ledger_row(lines, "relay", 7, "abc123")


def test_a_file_that_is_not_a_ledger_is_refused(tmp_path):
    bad = tmp_path / "ledger.tsv"
    bad.write_text("date\tcommit\n")
    with pytest.raises(ValueError, match="not a soak ledger"):
        cr.read_ledger(str(bad))
    bad.write_text("\t".join(cr.LEDGER_COLUMNS) + "\n" + "a\tb\n")
    with pytest.raises(ValueError, match="2 cells"):
        cr.read_ledger(str(bad))


def test_the_repos_ledger_parses():
    rows = cr.read_ledger(LEDGER)
    assert rows, "tests/soak/ledger.tsv is empty"
    assert len({(r["campaign"], r["seed"]) for r in rows}) == len(rows)  # no batch twice
