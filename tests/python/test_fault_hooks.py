"""The installed dcr injects no faults.

The failure campaigns crash, fail, pause and corrupt processes at named fault
points through DCR_TEST_* variables. Those hooks live only in dcr-faults, a
test binary built beside dcr from the same commands (tools/dcr/fault_hooks.h);
the dcr that is installed contains none of them, and the variables do nothing
to it. Both are checked here, each against dcr-faults, which must do what dcr
does not (so that neither check can pass for a wrong reason).
"""

from __future__ import annotations

import signal

from conftest import DCR_BIN, DCR_FAULTS_BIN, run_dcr

FAULT_VARIABLES = ("DCR_TEST_CRASH_AT", "DCR_TEST_FAIL_AT", "DCR_TEST_PAUSE_AT", "DCR_TEST_CORRUPT_NTH")


def test_the_installed_binary_holds_no_fault_hook(dcr_bin):
    shipped, test_build = DCR_BIN.read_bytes(), DCR_FAULTS_BIN.read_bytes()
    for name in FAULT_VARIABLES:
        assert name.encode() not in shipped, f"{DCR_BIN} reads {name}"
        assert name.encode() in test_build, f"{DCR_FAULTS_BIN} lacks {name}"
    version = run_dcr("--version")
    assert version.returncode == 0 and "dcr-faults" not in version.stdout, version


def _publish(binary, store, state, checkpoint, version, env):
    import subprocess

    return subprocess.run([str(binary), "publish", "--store", str(store), "--state", str(state), "--version",
                           str(version), str(checkpoint)], capture_output=True, text=True, timeout=120,
                          env={"DCR_PROGRESS": "0", "PATH": "/usr/bin:/bin", **env})


def test_fault_variables_do_nothing_to_dcr(tmp, gen_cache):
    gen, _ = gen_cache.get("llama", size="2MB", versions=1)
    for d in ("a", "b"):  # version 0 (a snapshot) in two runs; the fault points are version 1's
        first = _publish(DCR_BIN, tmp / f"store-{d}", tmp / f"state-{d}", gen / "v0", 0, {})
        assert first.returncode == 0, first
    crash = {"DCR_TEST_CRASH_AT": "committed"}
    # dcr-faults dies at the point, after the commit...
    killed = _publish(DCR_FAULTS_BIN, tmp / "store-a", tmp / "state-a", gen / "v1", 1, crash)
    assert killed.returncode == -signal.SIGKILL, killed
    assert "DCR_TEST_CRASH_AT: killing myself at committed" in killed.stderr
    # ...and dcr goes through it, with every fault variable set.
    everything = {**crash, "DCR_TEST_FAIL_AT": "frames-written", "DCR_TEST_PAUSE_AT": f"frames-written:{tmp / 'never'}"}
    ok = _publish(DCR_BIN, tmp / "store-b", tmp / "state-b", gen / "v1", 1, everything)
    assert ok.returncode == 0, ok
    assert "DCR_TEST" not in ok.stderr and "committed version 1" in ok.stdout, ok
