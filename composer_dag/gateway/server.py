"""The gateway over HTTP: the OpenAI-compatible API for harnesses, and an admin API for the
runner of episodes, on another port.

    python -m composer_dag.gateway --model DIR --upstream URL [URL ...] [--port P] [--admin-port Q]
        [--records DIR] [--max-model-len N]

Public (``Authorization: Bearer <episode key>``): ``POST /v1/chat/completions`` (``stream``
served as server-sent events), ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
Admin (``Authorization: Bearer <admin token>``, ``$COMPOSER_GATEWAY_ADMIN_TOKEN`` or printed
at start): ``POST /admin/keys`` (``{"episode", "max_calls"}`` -> ``{"key"}``),
``DELETE /admin/keys/<key>`` (closes it; ``?forget=1`` also drops its records),
``POST /admin/keys/<key>/session`` (ends a product session: a ``composer-session/2`` record, written
under ``--sessions``), ``GET /admin/records/<key>``, ``GET /admin/stats``. An episode's key reaches its harness only;
the admin token never leaves the runner.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from composer_dag.gateway.chat import BadRequest
from composer_dag.gateway.core import Gateway, Refused
from composer_dag.inference.server import ServerDown


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    gateway: Gateway
    admin_token: str | None = None

    def setup(self) -> None:
        super().setup()
        # a reply goes out as headers then body: without this, Nagle's algorithm holds the body
        # until the client's delayed ACK (about 40 ms a call)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args) -> None:  # one line per call would drown the logs
        pass

    def _bearer(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > 64 << 20:
            raise BadRequest("request body over 64 MiB")
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def _send(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
        self._send(status, {"error": {"message": message, "type": kind, "code": code, "param": None}})

    def _guard(self, fn) -> None:
        try:
            fn()
        except Refused as e:
            self._error(e.status, str(e), e.code, "rate_limit_error" if e.status == 429 else "invalid_request_error")
        except BadRequest as e:
            self._error(400, str(e), e.code)
        except ServerDown as e:
            self._error(503, f"no rollout server answered: {e}", "upstream_unavailable", "server_error")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class PublicHandler(_Handler):
    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/health":
            self._send(200, {"ok": True})
        elif path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.gateway.model, "object": "model",
                                                          "owned_by": "composer-dag"}]})
        else:
            self._error(404, f"no route {path}", "not_found")

    def do_POST(self) -> None:
        path = urlparse(self.path).path
        if path == "/v1/chat/completions":
            self._guard(lambda: self._chat(self._body()))
        elif path == "/v1/completions":
            self._guard(lambda: self._send(200, self.gateway.completions(self._bearer(), self._body())))
        else:
            self._guard(lambda: self._error(404, f"no route {path}", "not_found"))

    def _chat(self, body: dict) -> None:
        out = self.gateway.chat(self._bearer(), body)
        if body.get("stream"):
            self._stream(out, bool((body.get("stream_options") or {}).get("include_usage")))
        else:
            self._send(200, out)

    def _stream(self, out: dict, usage: bool) -> None:
        """The reply as server-sent events: the role, the content, each tool call, the finish."""
        choice, msg = out["choices"][0], out["choices"][0]["message"]
        head = {k: out[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        deltas = [{"role": "assistant", "content": ""}]
        if msg.get("content"):
            deltas.append({"content": msg["content"]})
        for i, c in enumerate(msg.get("tool_calls") or []):
            deltas.append({"tool_calls": [{"index": i, **c}]})
        events = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        events.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})
        if usage:
            events.append({**head, "choices": [], "usage": out["usage"]})
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class AdminHandler(_Handler):
    def _authorized(self) -> bool:
        if self.admin_token and not secrets.compare_digest(self._bearer() or "", self.admin_token):
            self._error(401, "admin token required", "invalid_api_key")
            return False
        return True

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = urlparse(self.path).path
        if path == "/admin/stats":
            self._send(200, self.gateway.stats())
        elif path.startswith("/admin/records/"):
            try:
                self._send(200, self.gateway.records(path.rsplit("/", 1)[1]))
            except KeyError:
                self._error(404, "no such key", "not_found")
        else:
            self._error(404, f"no route {path}", "not_found")

    def do_POST(self) -> None:
        if not self._authorized():
            return
        path = urlparse(self.path).path
        if path == "/admin/keys":
            def issue():
                b = self._body()
                self._send(200, {"key": self.gateway.issue(b.get("episode"), b.get("max_calls"))})
            self._guard(issue)
        elif path.startswith("/admin/keys/") and path.endswith("/session"):
            def close():
                try:
                    self._send(200, self.gateway.close_session(path.split("/")[3], self._body()))
                except KeyError:
                    self._error(404, "no such key", "not_found")
            self._guard(close)
        else:
            self._error(404, "no route", "not_found")

    def do_DELETE(self) -> None:
        if not self._authorized():
            return
        url = urlparse(self.path)
        if url.path.startswith("/admin/keys/"):
            key = url.path.rsplit("/", 1)[1]
            self.gateway.revoke(key)
            if parse_qs(url.query).get("forget"):
                self.gateway.forget(key)
            self._send(200, {"closed": key})
        else:
            self._error(404, "no route", "not_found")


class GatewayServer:
    """Both listeners of one ``Gateway``, each served by its own thread (``start``/``stop``)."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, admin_host: str = "127.0.0.1",
                 admin_port: int = 0, admin_token: str | None = None):
        self.gateway = gateway
        self.admin_token = admin_token or secrets.token_urlsafe(24)
        attrs = {"gateway": gateway, "admin_token": self.admin_token}
        self.public = _Server((host, port), type("Public", (PublicHandler,), attrs))
        self.admin = _Server((admin_host, admin_port), type("Admin", (AdminHandler,), attrs))
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        h, p = self.public.server_address[:2]
        return f"http://{h}:{p}/v1"

    @property
    def admin_url(self) -> str:
        h, p = self.admin.server_address[:2]
        return f"http://{h}:{p}"

    def start(self) -> "GatewayServer":
        for srv in (self.public, self.admin):
            t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
                                 name=f"gateway-{srv.server_address[1]}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        for srv in (self.public, self.admin):
            srv.shutdown()
            srv.server_close()
        self.gateway.upstream.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve_forever(server: GatewayServer, log=print) -> None:
    log(json.dumps({"gateway": server.url, "admin": server.admin_url}))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
