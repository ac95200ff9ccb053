"""A fault-injecting HTTP proxy on loopback, in front of an S3 server.

Every request is forwarded to ``upstream`` unless a rule matches it; a matching rule answers
instead with an S3 error (XML body as S3 sends it), resets the connection before answering
("reset"), sends the upstream answer's headers and half its body and then resets ("cut"), or
delays the answer ("slow"). Rules are tried in order; the first that fires wins::

    with FaultProxy(endpoint) as proxy:
        proxy.add("503", method="PUT", first=2)          # the first two PUTs get SlowDown
        proxy.add("reset", method="GET", path=r"\\.json$", first=1)
        proxy.add("500", fraction=0.2, seed=7)          # a seeded fifth of all requests
        proxy.add("slow", delay_s=1.0, first=1)          # the first request waits a second
        proxy.add("cut", method="GET", first=1)          # half a body, then a reset
        Storage("s3://bucket/root", {"endpoint_url": proxy.url, ...})

``proxy.log`` records ``(method, path, outcome)`` for every request, where outcome is the
upstream status or the fault injected (a "slow" one is logged when its delay starts).
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "403": (403, "AccessDenied", "Access Denied"),
}
ACTIONS = set(ERRORS) | {"reset", "cut", "slow"}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


@dataclass
class Rule:
    action: str
    method: str | None = None  # e.g. "PUT"; None matches every method
    path: str | None = None  # a regular expression searched in the path and query
    first: int | None = None  # fire on the first N matching requests only
    fraction: float | None = None  # fire on this share of matching requests (seeded)
    seed: int = 0
    delay_s: float = 0.0  # for "slow"
    message: str | None = None  # overrides the error message in the XML body
    fired: int = 0
    _rng: random.Random = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault {self.action!r}; one of {sorted(ACTIONS)}")
        self._rng = random.Random(self.seed)

    def matches(self, method: str, path: str) -> bool:
        if self.method and self.method != method:
            return False
        if self.path and not re.search(self.path, path):
            return False
        if self.first is not None and self.fired >= self.first:
            return False
        if self.fraction is not None and self._rng.random() >= self.fraction:
            return False
        return True


class FaultProxy:
    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                rule = proxy._pick(self.command, self.path)
                if rule is not None and rule.action == "reset":
                    proxy._record(self.command, self.path, "reset")
                    self._reset()
                    return
                if rule is not None and rule.action in ERRORS:
                    status, code, message = ERRORS[rule.action]
                    proxy._record(self.command, self.path, code)
                    self._send(status, _error_xml(code, rule.message or message, self.path), {"Content-Type": "application/xml"})
                    return
                if rule is not None and rule.action == "slow":
                    proxy._record(self.command, self.path, "slow")  # logged when it starts
                    time.sleep(rule.delay_s)
                try:
                    status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                except OSError:  # upstream gone (e.g. a slow answer outlived the server)
                    proxy._record(self.command, self.path, "upstream-error")
                    self._reset()
                    return
                if rule is not None and rule.action == "cut":
                    proxy._record(self.command, self.path, "cut")
                    self._send(status, data, headers, limit=len(data) // 2)
                    self._reset()
                    return
                if rule is None:
                    proxy._record(self.command, self.path, str(status))
                self._send(status, data, headers)

            def _reset(self) -> None:
                # SO_LINGER 0: close sends RST, the client sees "connection reset by peer"
                self.wfile.flush()
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _send(self, status: int, data: bytes, headers: dict[str, str], limit: int | None = None) -> None:
                try:
                    self.send_response(status)
                    length = str(len(data))
                    for k, v in headers.items():
                        if k.lower() == "content-length":
                            length = v if self.command == "HEAD" else length  # HEAD: the object's size
                        elif k.lower() not in HOP_BY_HOP:
                            self.send_header(k, v)
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data if limit is None else data[:limit])
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up (its read timeout)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # ---- control -----------------------------------------------------------------------
    def add(self, action: str, **kw) -> Rule:
        rule = Rule(action, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def outcomes(self, method: str | None = None) -> list[str]:
        with self._lock:
            return [o for m, _, o in self.log if method is None or m == method]

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- internals ---------------------------------------------------------------------
    def _pick(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path):
                    rule.fired += 1
                    return rule
        return None

    def _record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.log.append((method, path, outcome))

    def _forward(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"}
            out["Content-Length"] = str(len(body))
            conn.request(method, path, body=body, headers=out)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, dict(resp.getheaders()), data
        finally:
            conn.close()


def _error_xml(code: str, message: str, resource: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
    ).encode()
