"""The publisher's state (its baseline): in memory by default, a cache of the store.

Without --state (and without $DCR_STATE_DIR) `dcr publish` keeps its baseline under
/dev/shm/dcr-<uid>/publish/<store>, so advancing it after each commit writes nothing
to a disk. Measured as the bytes the publish process caused to be written to storage
(its rusage from wait4: ru_oublock, which Linux fills from the task's write_bytes);
beside it, a state directory on a disk, where every version writes the whole
checkpoint. A state that is gone (a reboot empties /dev/shm; another machine) is
rebuilt from the store, bit for bit.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from conftest import DCR_BIN, run_dcr


def _publish(args, cwd: Path) -> tuple[int, str, str, int]:
    """dcr publish ARGS: (returncode, stdout, stderr, bytes it caused to be written to storage)."""
    env = {k: v for k, v in os.environ.items() if k != "DCR_STATE_DIR"}
    env["DCR_PROGRESS"] = "0"
    with open(cwd / "out", "w+b") as out, open(cwd / "err", "w+b") as err:
        p = subprocess.Popen([str(DCR_BIN), "publish", *map(str, args)], stdout=out, stderr=err, env=env)
        guard = threading.Timer(120, p.kill)  # a hang fails the test
        guard.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            guard.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read().decode(), err.read().decode(), usage.ru_oublock * 512


def _disk_backed(d: Path) -> bool:
    """Whether writes into `d` reach a block device (its filesystem is not memory)."""
    p = subprocess.Popen(["dd", "if=/dev/zero", f"of={d / 'probe'}", "bs=1M", "count=4", "conv=fsync"],
                         stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(p.pid, 0)
    (d / "probe").unlink()
    return usage.ru_oublock * 512 >= 4 << 20


@pytest.fixture
def memory_store():
    """A file store in /dev/shm, so that its own writes are not disk writes."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="dcr-state-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_default_state_is_in_memory_and_a_lost_one_is_rebuilt(tmp_path, memory_store):
    gen = tmp_path / "gen"
    r = run_dcr("gen", "-o", gen, "--family", "llama", "--size", "32MB", "--versions", "3", "--seed", "5")
    assert r.returncode == 0, r
    store = f"file://{memory_store / 'store'}"

    rc, out, err, _ = _publish(["--store", store, "--version", "0", "--json", gen / "v0"], tmp_path)
    assert rc == 0, err
    state = Path(json.loads(out)["state_dir"])
    try:
        assert state.parent == Path(f"/dev/shm/dcr-{os.geteuid()}/publish"), state
        assert (state.parent.parent.stat().st_mode & 0o777) == 0o700
        for v in (1, 2):
            os.sync()  # were the state on a disk, its pages would be clean now, and each publish dirty them again
            rc, out, err, written = _publish(["--store", store, "--version", v, "--json", gen / f"v{v}"], tmp_path)
            assert rc == 0, err
            report = json.loads(out)
            assert report["state_dir"] == str(state) and report["frame_bytes"] > 0, report
            # The baseline moved through the whole checkpoint (every chunk changes at 3%); a few
            # records at most reached a disk.
            assert written <= 64 << 10, f"version {v}: {written} bytes written to storage"
            assert report["advance_seconds"] > 0 and report["baseline_seconds"] > 0, report
            memory = report["memory"]
            assert memory["baseline_in_memory"] and memory["baseline_bytes"] == report["total_bytes"], report
            assert 0 < memory["frames_in_flight_bytes"] <= report["frame_bytes"] + 4096, report
        # dcr status shows what the publisher held, from the commit record.
        status = run_dcr("status", "--store", store, "--json")
        assert status.returncode == 0, status
        assert json.loads(status.stdout)["versions"][-1]["publisher_memory"] == memory, status.stdout
        status = run_dcr("status", "--store", store)
        assert "publisher held a baseline of" in status.stdout and "(in memory)" in status.stdout, status.stdout
        assert filecmp.cmp(state / "baseline" / "model.safetensors", gen / "v2" / "model.safetensors", shallow=False)

        # A reboot empties /dev/shm: the next publish rebuilds the baseline from the store.
        shutil.rmtree(state)
        rc, out, err, _ = _publish(["--store", store, "--version", "3", "--json", gen / "v3"], tmp_path)
        assert rc == 0, err
        assert "rebuilding the baseline of version 2" in err, err
        assert filecmp.cmp(state / "baseline" / "model.safetensors", gen / "v3" / "model.safetensors", shallow=False)
    finally:
        shutil.rmtree(state, ignore_errors=True)

    # Beside it, a state directory on a disk: every version writes the checkpoint's size.
    if not _disk_backed(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk: nothing to compare with")
    store2 = f"file://{memory_store / 'store2'}"
    disk_state = tmp_path / "disk-state"
    rc, _, err, _ = _publish(["--store", store2, "--state", disk_state, "--version", "0", gen / "v0"], tmp_path)
    assert rc == 0, err
    os.sync()  # v0's copy written back
    rc, out, err, written = _publish(["--store", store2, "--state", disk_state, "--version", "1", "--json",
                                      gen / "v1"], tmp_path)
    assert rc == 0, err
    assert written >= json.loads(out)["total_bytes"] // 2, written
    assert not json.loads(out)["memory"]["baseline_in_memory"], out
