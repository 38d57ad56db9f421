"""HTTP faults between dcr and a real S3 server (the radosgw that
tests/s3/radosgw.sh starts), and a read-only S3 view of a store for the
campaign's watcher. Standard library only, independent of dcr's S3 driver.

FaultProxy listens on a loopback port and forwards each request unchanged
(the Host header too, so SigV4 signatures still hold) to the server. While
fault rates are set, each request may instead get:

  5xx      a 500 InternalError or 503 SlowDown reply; the server never sees it
  timeout  no reply: the connection is held for a while, then closed; the
           server never sees it
  lost     forwarded and done by the server, then the connection is closed
           without the reply: a lost response (a PUT that happened, a DELETE
           that happened, and the client cannot know)

S3View lists and reads objects under a store prefix with SigV4-signed
requests straight to the server (never through the proxy).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import random
import socket
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections import Counter

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


# ---------------------------------------------------------------- reading the store

class S3View:
    """GET and LIST under `prefix` of `bucket` at `endpoint` (http://host:port, path style)."""

    def __init__(self, endpoint: str, bucket: str, prefix: str, access_key: str, secret_key: str, region: str):
        u = urllib.parse.urlsplit(endpoint)
        self.host, self.port = u.hostname, u.port or 80
        self.hostport = u.netloc
        self.bucket, self.prefix = bucket, prefix
        self.access_key, self.secret_key, self.region = access_key, secret_key, region
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        return c

    def _request(self, method: str, path: str, query: dict[str, str]) -> tuple[int, bytes, dict]:
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        canonical_query = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
                                   for k, v in sorted(query.items()))
        canonical_path = urllib.parse.quote(path, safe="/-_.~")
        headers = {"host": self.hostport, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
        signed = ";".join(sorted(headers))
        canonical = "\n".join([method, canonical_path, canonical_query,
                               "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)), signed, EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + self.secret_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={signature}")
        target = canonical_path + ("?" + canonical_query if canonical_query else "")
        for attempt in range(3):
            try:
                c = self._conn()
                c.request(method, target, headers=headers)
                r = c.getresponse()
                return r.status, r.read(), dict(r.getheaders())
            except (OSError, http.client.HTTPException):
                self._local.conn = None
                if attempt == 2:
                    raise
                time.sleep(0.05)
        raise AssertionError("unreachable")

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        status, body, _ = self._request("GET", f"/{self.bucket}/{self.prefix}{key}", {})
        if status == 404:
            return None
        assert status == 200, f"GET {key}: HTTP {status}: {body[:300]!r}"
        return body

    def delete_all(self) -> int:
        """Deletes every object under the store's prefix (a passed campaign's
        run: radosgw's memstore is RAM); how many."""
        keys = list(self.keys())
        for k in keys:
            status, body, _ = self._request("DELETE", f"/{self.bucket}/{self.prefix}{k}", {})
            assert status in (200, 204, 404), f"DELETE {k}: HTTP {status}: {body[:300]!r}"
        return len(keys)

    def keys(self, prefix: str = "") -> dict[str, str]:
        """Every key under `prefix` (relative to the store), with its ETag."""
        out: dict[str, str] = {}
        token = None
        while True:
            q = {"list-type": "2", "prefix": self.prefix + prefix}
            if token:
                q["continuation-token"] = token
            status, body, _ = self._request("GET", f"/{self.bucket}", q)
            assert status == 200, f"LIST {prefix}: HTTP {status}: {body[:300]!r}"
            root = ET.fromstring(body)
            ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            for c in root.iter(f"{ns}Contents"):
                k = c.find(f"{ns}Key").text or ""
                etag = c.find(f"{ns}ETag")
                out[k[len(self.prefix):]] = etag.text if etag is not None else ""
            truncated = root.find(f"{ns}IsTruncated")
            token_el = root.find(f"{ns}NextContinuationToken")
            if truncated is None or truncated.text != "true" or token_el is None:
                return out
            token = token_el.text


# ---------------------------------------------------------------- the proxy

def _read_line(f) -> bytes:
    line = f.readline(65537)
    if not line:
        raise ConnectionError("closed")
    return line


def _read_body(f, headers: list[tuple[str, str]]) -> bytes:
    h = {k.lower(): v for k, v in headers}
    if "chunked" in h.get("transfer-encoding", "").lower():
        out = b""
        while True:
            size = int(_read_line(f).split(b";")[0].strip(), 16)
            if size == 0:
                while _read_line(f) not in (b"\r\n", b"\n"):
                    pass
                return out
            out += f.read(size)
            _read_line(f)
    n = int(h.get("content-length", "0") or 0)
    return f.read(n) if n else b""


class FaultProxy:
    """A threaded HTTP/1.1 proxy to `upstream` (http://host:port) that injects faults."""

    def __init__(self, upstream: str):
        u = urllib.parse.urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port or 80
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self.rates = {"5xx": 0.0, "timeout": 0.0, "lost": 0.0}
        self.hold_s = (0.05, 1.0)
        self.injected: Counter = Counter()  # since the last set_faults
        self.total_injected: Counter = Counter()
        self.requests = 0
        self._stop = False
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def set_faults(self, seed: int = 0, **rates: float) -> Counter:
        """Sets the rates (5xx=, timeout=, lost=; missing ones are 0) and returns
        the faults injected since the previous call."""
        with self._lock:
            done = self.injected
            self.injected = Counter()
            self._rng = random.Random(seed)
            self.rates = {"5xx": rates.get("5xx", 0.0), "timeout": rates.get("timeout", 0.0),
                          "lost": rates.get("lost", 0.0)}
        return done

    def close(self) -> None:
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def _draw(self) -> tuple[str | None, float]:
        with self._lock:
            self.requests += 1
            x = self._rng.random()
            hold = self._rng.uniform(*self.hold_s)
            for name in ("5xx", "timeout", "lost"):
                if x < self.rates[name]:
                    self.injected[name] += 1
                    self.total_injected[name] += 1
                    return name, hold
                x -= self.rates[name]
        return None, hold

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        up = None
        f = c.makefile("rb")
        try:
            while not self._stop:
                try:
                    request_line = _read_line(f)
                except (ConnectionError, OSError):
                    return
                if request_line in (b"\r\n", b"\n"):
                    continue
                method, target, _ = request_line.decode("latin-1").split(" ", 2)
                headers = []
                while True:
                    line = _read_line(f)
                    if line in (b"\r\n", b"\n"):
                        break
                    k, v = line.decode("latin-1").split(":", 1)
                    headers.append((k.strip(), v.strip()))
                body = _read_body(f, headers)
                fault, hold = self._draw()
                if fault == "5xx":
                    status, code = (503, "SlowDown") if hold < 0.5 else (500, "InternalError")
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                           f"<Message>injected by the test proxy</Message></Error>").encode()
                    head = (f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
                            f"Content-Length: {len(xml)}\r\n\r\n").encode()
                    c.sendall(head + (b"" if method == "HEAD" else xml))
                    continue
                if fault == "timeout":
                    time.sleep(hold)
                    return  # closed without a reply; the server never saw the request
                if up is None:
                    up = http.client.HTTPConnection(self.up_host, self.up_port, timeout=120)
                up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        up.putheader(k, v)
                up.putheader("Content-Length", str(len(body)))
                up.endheaders(body)
                r = up.getresponse()
                data = r.read()
                if r.will_close:
                    up.close()
                    up = None
                if fault == "lost":
                    return  # done by the server; the reply never arrives
                out = [f"HTTP/1.1 {r.status} {r.reason}\r\n"]
                for k, v in r.getheaders():
                    if k.lower() in ("transfer-encoding", "connection", "keep-alive"):
                        continue
                    if k.lower() == "content-length" and method != "HEAD":
                        continue
                    out.append(f"{k}: {v}\r\n")
                if method != "HEAD":
                    out.append(f"Content-Length: {len(data)}\r\n")
                out.append("\r\n")
                c.sendall("".join(out).encode("latin-1") + (b"" if method == "HEAD" else data))
        except (OSError, ValueError, http.client.HTTPException):
            return
        finally:
            with self._lock:
                self._conns.discard(c)
            try:
                c.close()
            except OSError:
                pass
            if up is not None:
                up.close()
