"""`dcr store`: listing stays inside a file store's root (issue 22)."""

from __future__ import annotations

import os

from conftest import dcr_ok, run_dcr


def test_ls_never_leaves_the_root(tmp):
    root = tmp / "store"
    dcr_ok("store", "put", root, "a/k", __file__)
    outside = tmp / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret").write_text("s")
    (outside / "dir" / "secret").write_text("s")
    os.symlink(outside, root / "out")
    os.symlink(outside, root / "a" / "out")
    os.symlink(outside / "secret", root / "file-link")

    # A full listing shows the store's objects only: links are skipped.
    r = dcr_ok("store", "ls", root)
    assert "a/k" in r.stdout and "secret" not in r.stdout and "1 objects" in r.stdout, str(r)

    # Prefixes that no key starts with are refused before any I/O.
    for prefix in ("../", "../outside/", "a/../../", "/", "/etc/", "a//"):
        r = run_dcr("store", "ls", root, prefix)
        assert r.returncode == 2, str(r)
        assert "bad key prefix" in r.stderr and "secret" not in r.stdout, str(r)

    # A prefix through a link is refused, naming it.
    for prefix, link in (("out/", "out"), ("out/dir/", "out"), ("a/out/", "a/out")):
        r = run_dcr("store", "ls", root, prefix)
        assert r.returncode == 2, str(r)
        assert f"'{link}' is a symbolic link" in r.stderr and "secret" not in r.stdout, str(r)

