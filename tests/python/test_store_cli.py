"""`dcr store`: listing stays inside a file store's root, and an S3 store
opened without credentials says so (issue 22)."""

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


def test_s3_without_credentials_warns_once_unless_anonymous(tmp):
    # No credentials anywhere: an empty HOME, no AWS variables. Port 9
    # refuses connections, so the listing itself fails fast.
    env = {k: None for k in os.environ if k.startswith("AWS_") or k == "DCR_S3_ENDPOINT"}
    env["HOME"] = tmp
    url = "s3://bkt/run?endpoint=http://127.0.0.1:9&region=r&max_attempts=1"
    r = run_dcr("store", "ls", url, env=env)
    assert r.returncode == 2, str(r)
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, str(r)
    assert "no S3 credentials found, requests are anonymous" in warnings[0], warnings
    assert "anonymous=1" in warnings[0] and "AWS_ACCESS_KEY_ID" in warnings[0], warnings

    r = run_dcr("store", "ls", url + "&anonymous=1", env=env)
    assert r.returncode == 2, str(r)
    assert "warning" not in r.stderr, str(r)
    r = run_dcr("store", "ls", url + "&access_key_id=AK&secret_access_key=SK", env=env)
    assert "warning" not in r.stderr, str(r)
