"""Shared fixtures for the dcr CLI tests.

The binary is found through the DCR_BIN environment variable, defaulting to
<repo>/build/tools/dcr/dcr. Helpers here are deliberately independent of dcr:
they parse safetensors files with the standard library so that the tests
compare dcr against a second implementation, not against itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Several tests stop real child processes with SIGINT (Ctrl-C). A child
# inherits an ignored SIGINT from its parent, and a suite started in the
# background by a shell without job control (`cmd &` in a script) has it
# ignored; a handler here becomes the default disposition in every child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[2]
DCR_BIN = Path(os.environ.get("DCR_BIN", REPO / "build" / "tools" / "dcr" / "dcr"))
# dcr-faults: the same commands with the DCR_TEST_* fault points
# (tools/dcr/fault_hooks.h), built with the tests; the installed dcr has none.
DCR_FAULTS_BIN = Path(os.environ.get("DCR_FAULTS_BIN", DCR_BIN.parent / "dcr-faults"))


def dcr_binary(env: dict | None) -> Path:
    """dcr, or dcr-faults for a process whose environment asks for a DCR_TEST_* fault."""
    if not any(k.startswith("DCR_TEST_") and v for k, v in (env or {}).items()):
        return DCR_BIN
    if not DCR_FAULTS_BIN.is_file():
        pytest.fail(f"dcr-faults not found at {DCR_FAULTS_BIN}; build it (ninja -C build dcr-faults) or set DCR_FAULTS_BIN")
    return DCR_FAULTS_BIN

# Every run of dcr gets at most this long; a hang is a failure, not a stall.
RUN_TIMEOUT_S = 60


@dataclass
class Run:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError as e:  # pragma: no cover - failure path
            raise AssertionError(f"dcr {' '.join(self.args)}: stdout is not JSON ({e}):\n{self.stdout[:2000]}")

    def __str__(self) -> str:
        return (f"dcr {' '.join(self.args)} -> rc {self.returncode}\n"
                f"stdout: {self.stdout[:2000]}\nstderr: {self.stderr[:2000]}")


def run_dcr(*args, timeout: float = RUN_TIMEOUT_S, env: dict | None = None) -> Run:
    """Runs dcr with `args` (converted to str) and returns what it did.
    `env` adds to (or, with None values, removes from) the environment."""
    argv = [str(a) for a in args]
    full_env = dict(os.environ)
    full_env.setdefault("DCR_PROGRESS", "0")
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = str(v)
    p = subprocess.run([str(dcr_binary(full_env)), *argv], capture_output=True, timeout=timeout, env=full_env)
    return Run(argv, p.returncode,
               p.stdout.decode("utf-8", errors="replace"),
               p.stderr.decode("utf-8", errors="replace"))


def dcr_ok(*args, expect: int = 0, env: dict | None = None) -> Run:
    """Runs dcr and asserts its exit code."""
    r = run_dcr(*args, env=env)
    assert r.returncode == expect, str(r)
    return r


def dcr_json(*args, expect: int = 0, env: dict | None = None):
    """Runs dcr with `args` (which should include --json), asserts the exit
    code and returns the parsed stdout."""
    return dcr_ok(*args, expect=expect, env=env).json()


def assert_no_crash(r: Run) -> None:
    """A crash shows as a negative return code (signal) or >= 128 (shell)."""
    assert 0 <= r.returncode < 128, f"dcr crashed: {r}"


# ---------------------------------------------------------------- safetensors

@dataclass
class RawTensor:
    name: str
    dtype: str
    shape: list[int]
    data: bytes
    file: str


def read_safetensors_file(path) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """A minimal, independent safetensors reader: tensors and __metadata__."""
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        out[name] = RawTensor(name, e["dtype"], list(e["shape"]), blob[base + b:base + end], str(path))
    return out, meta


def read_checkpoint(path) -> dict[str, RawTensor]:
    """All tensors of a .safetensors file or a checkpoint directory."""
    p = Path(path)
    if p.is_file():
        return read_safetensors_file(p)[0]
    index = p / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else sorted(f.name for f in p.glob("*.safetensors")))
    out: dict[str, RawTensor] = {}
    for f in files:
        tensors, _ = read_safetensors_file(p / f)
        for k, v in tensors.items():
            assert k not in out, f"{k} stored twice"
            out[k] = v
    return out


def write_raw_safetensors(path, header: dict | list | str | bytes, data: bytes = b"",
                          header_len: int | None = None, pad: bool = True) -> Path:
    """Writes a safetensors-like file byte by byte, valid or not. `header`
    may be an object (dumped as JSON), a str or raw bytes; `header_len`
    overrides the length prefix."""
    if isinstance(header, (dict, list)):
        text = json.dumps(header, separators=(",", ":")).encode()
    elif isinstance(header, str):
        text = header.encode()
    else:
        text = header
    if pad and isinstance(header, dict):
        text += b" " * ((8 - len(text) % 8) % 8)
    n = len(text) if header_len is None else header_len
    p = Path(path)
    p.write_bytes(struct.pack("<Q", n) + text + data)
    return p


# ------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def dcr_bin() -> Path:
    if not DCR_BIN.is_file() or not os.access(DCR_BIN, os.X_OK):
        pytest.fail(f"dcr binary not found at {DCR_BIN}; build it (ninja -C build dcr) or set DCR_BIN")
    return DCR_BIN


@pytest.fixture
def tmp(tmp_path, dcr_bin) -> Path:
    """A fresh directory per test (requires the binary to exist)."""
    return tmp_path


class GenCache:
    """`dcr gen` runs shared across the session, keyed by their arguments."""

    def __init__(self, root: Path):
        self.root = root
        self.runs: dict[tuple, tuple[Path, dict]] = {}

    def get(self, family: str, update: str = "training", rate: float = 0.03, seed: int = 1,
            size: str = "2MB", versions: int = 2, shard_size: str | None = None) -> tuple[Path, dict]:
        key = (family, update, rate, seed, size, versions, shard_size)
        if key not in self.runs:
            out = self.root / f"gen{len(self.runs)}"
            args = ["gen", "-o", out, "--family", family, "--size", size, "--versions", versions,
                    "--update", update, "--rate", rate, "--seed", seed, "--json"]
            if shard_size:
                args += ["--shard-size", shard_size]
            doc = dcr_json(*args)
            self.runs[key] = (out, doc)
        return self.runs[key]


@pytest.fixture(scope="session")
def gen_cache(tmp_path_factory, dcr_bin) -> GenCache:
    return GenCache(tmp_path_factory.mktemp("gen"))


@contextlib.contextmanager
def following(rx, store, state_dir, **kwargs):
    """``rx.follow(store, state_dir, **kwargs)`` on a thread (it releases the
    GIL) while the body publishes: entered once the receiver registered in
    the store, yields the list that receives follow's result (or exception);
    joins the thread on exit."""
    result: list = []

    def follow():
        try:
            result.append(rx.follow(store, state_dir, **kwargs))
        except BaseException as e:  # noqa: BLE001 - reported through `result`
            result.append(e)

    t = threading.Thread(target=follow)
    t.start()
    try:
        deadline = time.monotonic() + 120  # a guard only: the body's publishes wait for this receiver
        while not store.list("receivers/"):
            assert t.is_alive() and time.monotonic() < deadline, f"the receiver did not register: {result}"
            time.sleep(0.01)
        yield result
    finally:
        t.join(60)
