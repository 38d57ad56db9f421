"""The installed wheel on its own: run by scripts/test_wheel.sh in a fresh
venv holding only the wheel and its test dependencies, from a directory
outside the source tree, with DCR_BIN naming the venv's `dcr` command."""

from __future__ import annotations

import http.server
import os
import shutil
import ssl
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

import dcr

VENV = Path(sys.prefix)
DCR = Path(shutil.which("dcr") or "dcr")


def run(*args, env=None, check=True) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "DCR_PROGRESS": "0", **(env or {})}
    p = subprocess.run([str(DCR), *map(str, args)], capture_output=True, text=True, env=full_env, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"dcr {args} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def test_the_package_and_the_command_come_from_the_venv():
    assert Path(dcr.__file__).resolve().is_relative_to(VENV.resolve()), dcr.__file__
    assert DCR.resolve().parent == Path(sysconfig.get_path("scripts")).resolve()
    assert run("--version").stdout.splitlines()[0] == "dcr 0.1.0"
    # The native code is the wheel's: no library of the build machine but glibc's.
    for elf in (DCR, Path(dcr._dcr.__file__)):
        needed = subprocess.run(["readelf", "-d", str(elf)], capture_output=True, text=True, check=True).stdout
        libs = sorted(line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line)
        assert set(libs) <= {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                             "ld-linux-x86-64.so.2"}, (elf, libs)


def test_publish_and_follow_round_trip_is_bit_exact(tmp_path):
    run("gen", "-o", tmp_path / "run", "--family", "llama", "--size", "8MB", "--versions", "2",
        "--update", "training", "--rate", "0.03")
    store = f"file://{tmp_path / 'store'}"
    for v in range(3):
        run("publish", "--store", store, "--version", v, "--state", tmp_path / "state", tmp_path / "run" / f"v{v}")
    run("follow", "--store", store, "--id", "r0", "--until", 2, "--poll", "0.05", tmp_path / "r0")
    diff = run("diff", "--json", "--summary", tmp_path / "run" / "v2", tmp_path / "r0", check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr


@pytest.fixture
def https_server(tmp_path):
    """An HTTPS server with a self-signed certificate for 127.0.0.1 that
    answers every GET with the request path (and HEAD with its size)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=dcr-test",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def body(self) -> bytes:
            return f"over tls: {self.path}".encode()

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body())))
            self.send_header("ETag", '"1"')
            self.end_headers()

        def do_GET(self):
            self.do_HEAD()
            self.wfile.write(self.body())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()
    thread.join()


def test_https_verifies_the_server_against_the_ca_bundle(https_server, tmp_path):
    endpoint, cert = https_server
    url = f"s3://bucket?endpoint={endpoint}&anonymous=1&region=us-east-1"
    trusted = run("store", "cat", url, "some/key", env={"SSL_CERT_FILE": str(cert)})
    assert trusted.stdout == "over tls: /bucket/some/key"
    # The distribution's bundle (found without SSL_CERT_FILE) does not trust
    # the self-signed certificate: the request fails, and says why.
    untrusted = run("store", "cat", url, "some/key", env={"SSL_CERT_FILE": ""}, check=False)
    assert untrusted.returncode != 0
    assert "certificate" in untrusted.stderr.lower(), untrusted.stderr
