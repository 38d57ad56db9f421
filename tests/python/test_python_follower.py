"""dcr.Follower.run's Python side: the post-update hook (on_version), an
exception from it, and Ctrl-C (SIGINT to a real follower process) stopping
the loop cleanly with the target at a whole version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import dcr

from conftest import read_checkpoint
from test_python_package import published_run


def published(tmp_path, versions: int):
    return published_run(tmp_path, versions, tensors=6, seed=30, ack_timeout_s=0.5)


def test_on_version_is_called_after_each_version_the_target_reaches(tmp_path):
    store, pub, vs = published(tmp_path, 3)
    for v in range(1, 4):
        pub.publish(v, tmp_path / f"v{v}")
    seen = []

    def hook(version):  # the target already holds `version` when the hook runs
        raw = read_checkpoint(tmp_path / "engine")
        seen.append((version, all(raw[n].data == t.contiguous().view(torch.uint8).numpy().tobytes()
                                  for n, t in vs[version].items())))

    fol = dcr.Follower(store, tmp_path / "engine", id="rx-hook", poll_s=0.01)
    assert fol.run(until=3, timeout_s=60, on_version=hook) == 3
    # Joined at version 0 from its snapshot, then one committed delta at a time.
    assert seen == [(1, True), (2, True), (3, True)]


def test_an_exception_from_the_hook_stops_the_loop_and_is_raised(tmp_path):
    store, pub, _ = published(tmp_path, 2)
    for v in (1, 2):
        pub.publish(v, tmp_path / f"v{v}")

    def hook(version):
        raise ValueError(f"rederive failed at {version}")

    fol = dcr.Follower(store, tmp_path / "engine", id="rx-bad", poll_s=0.01)
    with pytest.raises(ValueError, match="rederive failed at 1"):
        fol.run(until=2, timeout_s=60, on_version=hook)
    assert fol.version == 1  # stopped after the first version, which is whole
    assert dcr.Follower(store, tmp_path / "engine", id="rx-bad", poll_s=0.01).run(until=2, timeout_s=60) == 2


CHILD = textwrap.dedent("""
    import sys, dcr
    store = dcr.open_store(sys.argv[1])
    fol = dcr.Follower(store, sys.argv[2], id="rx-sigint", poll_s=0.05)
    try:
        fol.run(on_version=lambda v: print("version", v, flush=True))  # forever
    except KeyboardInterrupt:
        print("interrupted at", fol.version, flush=True)
        sys.exit(0)
    sys.exit(3)
""")


def test_ctrl_c_stops_follower_run_cleanly(tmp_path):
    store, pub, vs = published(tmp_path, 1)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen([sys.executable, "-c", CHILD, store.url, str(tmp_path / "engine")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # Publish version 1: it commits once the child acks it (or it is retired
        # after the short ack timeout if it has not joined yet; it catches up).
        pub.publish(1, tmp_path / "v1")
        line = child.stdout.readline()
        assert line.strip() == "version 1", line + child.stderr.read()
        # No need to wait until the hook has returned: a SIGINT still in it
        # raises KeyboardInterrupt from the hook, which stops the loop the
        # same way as one taken at the next store poll.
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)  # a guard only
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert out.strip() == "interrupted at 1", out + err
    raw = read_checkpoint(tmp_path / "engine")
    for n, t in vs[1].items():
        assert raw[n].data == t.contiguous().view(torch.uint8).numpy().tobytes(), n
    # The loop recorded its stop in its receiver record.
    records = [k for k, _, _ in store.list("") if "rx-sigint" in k]
    assert records, store.list("")
    assert any(json.loads(store.get(k)).get("state") == "stopped" for k in records), \
        [store.get(k) for k in records]
