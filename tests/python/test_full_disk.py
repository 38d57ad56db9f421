"""A full disk during a refit: clear errors with a way forward, committed state untouched.

A tmpfs smaller than the checkpoint stands in for a full filesystem (mounting it
needs root, or sudo without a password, as in CI; elsewhere the tests skip). A
receiver that joins into it and a publisher that keeps its baseline on it must
fail with a message naming the directory, the bytes needed and what to do, leave
no partial files behind, and leave the store's committed versions intact: a
receiver with room still reaches the exact bits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import DCR_BIN, run_dcr


def _mount_cmd(*args: str) -> list[str]:
    if os.geteuid() == 0:
        return list(args)
    return ["sudo", "-n", *args]


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 2 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    p = subprocess.run(_mount_cmd("mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)), capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or sudo): {p.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(_mount_cmd("umount", "-l", str(mnt)), capture_output=True)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    gen = tmp_path / "gen"
    r = run_dcr("gen", "-o", gen, "--family", "llama", "--size", "8MB", "--versions", "1", "--seed", "3")
    assert r.returncode == 0, r
    return gen


def _assert_full_disk_message(r, directory: Path):
    assert r.returncode != 0, r
    assert "no space left in" in r.stderr, r
    assert str(directory) in r.stderr, r
    assert "free space" in r.stderr, r


def test_receiver_joining_into_a_full_disk_fails_cleanly(tmp_path, small_fs, model):
    store = f"file://{tmp_path / 'store'}"
    r = run_dcr("publish", "--store", store, "--state", tmp_path / "state", "--version", "0", model / "v0")
    assert r.returncode == 0, r

    target = small_fs / "target"
    r = run_dcr("follow", "--store", store, "--until", "0", "--id", "full", target)
    _assert_full_disk_message(r, target)
    assert not [p for p in target.iterdir() if p.name.endswith(".dcr-part")], "a partial file was left behind"

    # The store is intact: a receiver with room joins v0, and v1 commits for it.
    ok_target = tmp_path / "ok"
    r = run_dcr("follow", "--store", store, "--until", "0", "--id", "ok", ok_target)
    assert r.returncode == 0, r
    r = run_dcr("diff", "--summary", ok_target, model / "v0")
    assert r.returncode == 0, r


def test_publisher_baseline_on_a_full_disk_fails_cleanly_and_can_be_redone(tmp_path, small_fs, model):
    store = f"file://{tmp_path / 'store'}"
    state = small_fs / "state"
    r = run_dcr("publish", "--store", store, "--state", state, "--version", "0", model / "v0")
    _assert_full_disk_message(r, state)

    # Version 0 itself was committed before the baseline copy; publishing it
    # again from a state directory with room finishes the job, and v1 follows.
    good_state = tmp_path / "state"
    r = run_dcr("publish", "--store", store, "--state", good_state, "--version", "0", model / "v0")
    assert r.returncode == 0, r
    receiver = tmp_path / "r"
    follower = subprocess.Popen(
        [str(DCR_BIN), "follow", "--store", store, "--until", "1", "--id", "r", "--poll", "0.02", str(receiver)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        r = run_dcr("publish", "--store", store, "--state", good_state, "--version", "1", "--ack-timeout", "30",
                    model / "v1")
        assert r.returncode == 0, r
        out, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err.decode(errors="replace")
    finally:
        if follower.poll() is None:
            follower.kill()
    r = run_dcr("diff", "--summary", receiver, model / "v1")
    assert r.returncode == 0, r
