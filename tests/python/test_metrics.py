"""Prometheus metrics (docs/metrics.md): each process of a refit serves
/metrics when asked, and what it counts agrees with the publish report and
the store.

test_each_process_of_a_refit_serves_metrics_that_agree
    a relay root, a follower under it and a publisher each serve --metrics
    on a free port. Scraped while the publisher stands after its report
    (DCR_TEST_PAUSE_AT=reported): the publisher's versions, attempts,
    retries, changed words, receivers and bytes sent (store and relay) equal
    its report and the frame objects in the store; the relay took exactly
    those bytes from the publisher and sent them to the follower; the
    follower holds the version, took at least those bytes, and acked once.
test_the_python_publisher_and_receiver_serve_metrics
    ShardPublisher(metrics=...) and Receiver(metrics=...) in one process: a
    scrape of the URL they give shows the publish report's attempts and
    version and the receiver's version after it followed.
test_bad_addresses_and_requests_are_refused
    malformed --metrics addresses and a port in use are refused with the
    reason, before anything is published; non-GET requests and other paths
    get 405 and 404 and the endpoint stays up.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import DCR_FAULTS_BIN, dcr_ok, following, run_dcr

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$')


def scrape(url: str) -> dict:
    """Every sample of a scrape, by name and sorted label pairs."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def metrics_url(log: Path, timeout: float = 30) -> str:
    """The URL a dcr process printed ('metrics at URL') once it serves."""
    deadline = time.monotonic() + timeout
    while not (m := re.search(r"metrics at (http://\S+)", log.read_text(errors="replace") if log.exists() else "")):
        assert time.monotonic() < deadline, f"{log} never said where its metrics are:\n{log.read_text()}"
        time.sleep(0.05)
    return m.group(1)


def until(condition, what: str, timeout: float = 60):
    """Polls `condition` until it returns a true value (a guard against a hang, not a timing)."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, DCR_PROGRESS="0")
    for k in ("DCR_STORE_FAULTS", "DCR_TEST_CRASH_AT", "DCR_TEST_FAIL_AT", "DCR_TEST_PAUSE_AT", "DCR_STATE_DIR"):
        e.pop(k, None)
    return e


def committed_objects(store: Path, version: int, attempt: str) -> int:
    """Bytes of the committed attempt's frame objects in a file store (docs/protocol.md, "Layout in the store")."""
    frames = store / "attempts" / f"v{version:010d}" / attempt / "frames"
    return sum(p.stat().st_size for p in frames.iterdir())


def test_each_process_of_a_refit_serves_metrics_that_agree(tmp, gen_cache):
    gen, _ = gen_cache.get("llama", size="2MB", versions=1)
    store = tmp / "store"
    dcr_ok("publish", "--store", store, "--state", tmp / "state", "--version", 0, gen / "v0")
    listen = f"tcp://127.0.0.1:{free_port()}"
    procs, logs = [], {name: tmp / f"{name}.log" for name in ("relay", "follow", "publish")}
    try:
        procs.append(subprocess.Popen(
            [str(DCR_FAULTS_BIN), "relay", "--id", "root", "--listen", listen, "--insecure", "--metrics", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=logs["relay"].open("w"), env=env()))
        relay_url = metrics_url(logs["relay"])
        procs.append(subprocess.Popen(
            [str(DCR_FAULTS_BIN), "follow", "--store", str(store), str(tmp / "rx"), "--id", "rx0", "--relay", listen,
             "--relay-insecure", "--metrics", "127.0.0.1:0", "--poll", "0.05"],
            stdout=subprocess.DEVNULL, stderr=logs["follow"].open("w"), env=env()))
        follow_url = metrics_url(logs["follow"])
        until(lambda: value(scrape(follow_url), "dcr_receiver_version", receiver="rx0") == 0
              and ("dcr_receiver_version", (("receiver", "rx0"),)) in scrape(follow_url), "the follower joined")
        release = tmp / "release"
        publisher = subprocess.Popen(
            [str(DCR_FAULTS_BIN), "publish", "--store", str(store), "--state", str(tmp / "state"), "--version", "1",
             str(gen / "v1"), "--relay", listen, "--relay-insecure", "--metrics", "127.0.0.1:0", "--json"],
            stdout=subprocess.PIPE, stderr=logs["publish"].open("w"), text=True,
            env=dict(env(), DCR_TEST_PAUSE_AT=f"reported:{release}"))
        procs.append(publisher)
        publish_url = metrics_url(logs["publish"])
        until(lambda: "waiting at reported" in logs["publish"].read_text(), "the publisher reported", timeout=120)
        pub = scrape(publish_url)
        rx = until(lambda: (s := scrape(follow_url)) and value(s, "dcr_receiver_version", receiver="rx0") == 1 and s,
                   "the follower holds version 1")
        release.touch()
        out, _ = publisher.communicate(timeout=60)
        assert publisher.returncode == 0, logs["publish"].read_text()
        report = json.loads(out)
        objects = committed_objects(store, 1, report["attempt"])
        assert objects > report["frame_bytes"] > 0
        relay = until(lambda: (s := scrape(relay_url)) and value(
            s, "dcr_relay_link_bytes_total", relay="root", peer="rx0", kind="receiver", direction="out") >= objects and s,
            "the relay exported what it sent")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()

    # The publisher: what its report says, and the frame objects the store holds.
    assert value(pub, "dcr_publish_versions_committed_total") == 1
    assert value(pub, "dcr_publish_attempts_total") == report["attempts"] == 1
    assert value(pub, "dcr_publish_retries_total") == 0
    assert value(pub, "dcr_publish_failures_total") == 0
    assert value(pub, "dcr_publish_version") == 1
    assert value(pub, "dcr_publish_changed_words_total") == report["changed_words"] > 0
    assert value(pub, "dcr_publish_receivers", state="acked") == len(report["acked"]) == 1
    assert value(pub, "dcr_publish_sent_bytes_total", link="store") == objects
    assert value(pub, "dcr_publish_sent_bytes_total", link="relay") == objects
    assert value(pub, "dcr_publish_relay_acks_total") == report["relay_acks"]
    for stage, key in (("encode", "encode_seconds"), ("ack_wait", "wait_seconds"), ("total", "total_seconds"),
                       ("commit", "commit_seconds")):
        assert value(pub, "dcr_publish_stage_seconds_count", stage=stage) == 1
        assert value(pub, "dcr_publish_stage_seconds_sum", stage=stage) == pytest.approx(report[key], abs=1e-6)
    # The relay: in from the publisher, out to the follower, the same bytes.
    senders = [k for k in relay if k[0] == "dcr_relay_link_bytes_total" and ("kind", "sender") in k[1]
               and ("direction", "in") in k[1]]
    assert sum(relay[k] for k in senders) == objects
    assert value(relay, "dcr_relay_objects_total", relay="root", result="corrupt") == 0
    # The follower: the version, once applied and acked, and every frame object's bytes.
    assert value(rx, "dcr_receiver_versions_applied_total", receiver="rx0") == 2  # the join, then version 1
    assert value(rx, "dcr_receiver_joins_total", receiver="rx0") == 1
    assert value(rx, "dcr_receiver_acks_total", receiver="rx0", result="ok") == 1
    assert ("dcr_receiver_lag_seconds", (("receiver", "rx0"),)) in rx
    took = sum(value(rx, "dcr_receiver_received_bytes_total", receiver="rx0", link=link) for link in ("relay", "store"))
    assert took >= objects
    assert value(rx, "dcr_receiver_stage_seconds_count", receiver="rx0", stage="apply") == 2


def test_the_python_publisher_and_receiver_serve_metrics(tmp_path):
    torch = pytest.importorskip("torch")
    import dcr

    # The counters are the process's: other tests in this process count too, so the test looks at what it adds.
    before = scrape(dcr.serve_metrics("127.0.0.1:0"))
    store = dcr.open_store(str(tmp_path / "store"))
    trainer = {"w": torch.arange(4096, dtype=torch.float32).to(torch.bfloat16)}
    pub = dcr.ShardPublisher(store, tmp_path / "trainer", [trainer], ack_timeout_s=30, metrics="127.0.0.1:0")
    snapshot = pub.publish_snapshot(trainer)
    served = {"w": trainer["w"].clone()}
    rx = dcr.Receiver(served, metrics="127.0.0.1:0")
    assert pub.metrics_url.startswith("http://127.0.0.1:") and pub.metrics_url.endswith("/metrics")
    trainer["w"][::7] += 1
    with following(rx, store, tmp_path / "rx", engine="metrics-test", until=1) as done:
        report = pub.publish(1)
    assert done == [1] and torch.equal(served["w"], trainer["w"])
    for url in (pub.metrics_url, rx.metrics_url):  # one process: both endpoints serve the same families
        samples = scrape(url)
        added = {name: value(samples, name) - value(before, name)
                 for name in ("dcr_publish_attempts_total", "dcr_publish_versions_committed_total")}
        assert added["dcr_publish_attempts_total"] == snapshot["attempts"] + report["attempts"] == 2
        assert added["dcr_publish_versions_committed_total"] == 2
        assert value(samples, "dcr_publish_version") == 1
        assert value(samples, "dcr_receiver_version", receiver="metrics-test-r0") == 1
        assert value(samples, "dcr_receiver_acks_total", receiver="metrics-test-r0", result="ok") == 1
    assert dcr.metrics_text().count("# TYPE dcr_publish_attempts_total counter") == 1


def test_bad_addresses_and_requests_are_refused(tmp):
    for address, reason in (("9400", "not HOST:PORT"), ("host:70000", "port from 0 to 65535"),
                            ("::1:9400", "IPv6 host in brackets")):
        r = run_dcr("follow", "--store", tmp / "store", tmp / "rx", "--until", 0, "--metrics", address)
        assert r.returncode == 2 and reason in r.stderr and "--metrics" in r.stderr, r
    import dcr

    url = dcr.serve_metrics("127.0.0.1:0")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(dcr.UnavailableError, match="cannot listen on"):
        dcr.serve_metrics(f"127.0.0.1:{port}")  # taken by the first
    r = run_dcr("follow", "--store", tmp / "store", tmp / "rx", "--metrics", f"127.0.0.1:{port}")
    assert r.returncode == 2 and "cannot listen on" in r.stderr, r
    for method, path, code in (("POST", "/metrics", 405), ("GET", "/", 404)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url.replace("/metrics", path), method=method), timeout=10)
        assert e.value.code == code
    assert scrape(url)  # still serving
