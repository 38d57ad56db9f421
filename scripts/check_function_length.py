#!/usr/bin/env python3
"""Checks that no function body in src/, tools/ and python/src/ (bench/ mains
aside, and src/testing/, test scaffolding) is longer than LIMIT lines, so that
each step of a walk reads on one screen.

A function body is a '{' that ends a line whose code closes a parameter list
(`) {`, `) const {`, `) -> T {`, ...) and is not an if/for/while/switch/catch;
lambdas count as functions of their own. Strings and comments are ignored.
Tests (*_test.cc) are not checked. Exits 1 and names each long body. Run by
scripts/test.sh.

    scripts/check_function_length.py [--limit N] [PATH...]   (default: src tools python/src)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 80
OPENS_BODY = re.compile(r"\)\s*(const\s*)?(noexcept\s*)?(override\s*)?(->\s*[\w:<>,\s\*&]+)?\{\s*$")
CONTROL = re.compile(r"\b(if|for|while|switch|catch)\s*\(")


def code_of(line: str) -> str:
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split("//")[0]


def long_bodies(path: Path, limit: int) -> list[tuple[int, int, str]]:
    out = []
    stack: list[tuple[int, bool, str]] = []
    for number, raw in enumerate(path.read_text().split("\n"), 1):
        code = code_of(raw)
        for i, ch in enumerate(code):
            if ch == "{":
                before = code[: i + 1]
                is_body = bool(OPENS_BODY.search(before)) and not CONTROL.search(before.strip())
                stack.append((number, is_body, code.strip()))
            elif ch == "}" and stack:
                start, is_body, what = stack.pop()
                if is_body and number - start + 1 > limit:
                    out.append((start, number - start + 1, what))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=LIMIT)
    ap.add_argument("paths", nargs="*", default=["src", "tools", "python/src"])
    args = ap.parse_args()
    files = []
    for p in args.paths:
        p = ROOT / p
        files += sorted(f for f in ([p] if p.is_file() else p.rglob("*")) if f.suffix in (".cc", ".h"))
    found = []
    for f in files:
        if f.name.endswith("_test.cc") or "testing" in f.relative_to(ROOT).parts[:2]:
            continue
        for start, lines, what in long_bodies(f, args.limit):
            found.append(f"{f.relative_to(ROOT)}:{start}: {lines} lines (limit {args.limit}): {what[:80]}")
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} function bodies over {args.limit} lines: split them by step", file=sys.stderr)
        return 1
    print(f"no function body over {args.limit} lines in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
