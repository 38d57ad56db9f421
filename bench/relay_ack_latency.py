#!/usr/bin/env python3
"""Commit latency after the last ack (issue 6), with the receivers' acks
coming up the relay tree and without (`dcr publish --no-relay-acks`: the
coordinator polls the store every 20 ms, listing the acks and reading each
receiver's record). The tree of tests/python/test_relay.py: 5 relays (fanout
2, depth 2), 8 receivers, a file:// store, CURVE on.

Latency of a version: the commit record's mtime minus the newest ack's
mtime in the store (each receiver writes its ack there before it sends it up
the tree). The kernel stamps files with a coarse clock (about 4 ms here), so
the figure is a mean over VERSIONS versions per mode, alternating modes.

  bench/relay_ack_latency.py [--versions 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from test_relay import PLACEMENT, Tree, start_tree  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=10, help="versions per mode")
    a = ap.parse_args()
    n = 2 * a.versions
    with tempfile.TemporaryDirectory(prefix="dcr-ack-latency-") as tmp:
        t = Tree(Path(tmp), versions=n)
        try:
            start_tree(t, until=n)
            tree, store = [], []
            for v in range(1, n + 1):
                by_tree = v % 2 == 1
                report = t.publish_ok(v, extra=() if by_tree else ("--no-relay-acks",))
                assert report["relay_acks"] == (len(PLACEMENT) if by_tree else 0), report
                (tree if by_tree else store).append(1000 * t.commit_latency(v))
            t.wait_receivers()
            t.assert_exact(n)
        finally:
            t.kill_all()
    for name, xs in (("acks up the tree", tree), ("polling the store", store)):
        print(f"{name}: mean {statistics.mean(xs):.1f} ms, median {statistics.median(xs):.1f} ms, "
              f"max {max(xs):.1f} ms over {len(xs)} versions")


if __name__ == "__main__":
    main()
