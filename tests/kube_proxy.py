"""A loopback HTTPS proxy in front of the real API server (tests/control_plane.py), for
what the real server cannot be made to do on demand: it records every request a client
sends through it (method and path, query included), and a `Fault` answers one kind of
request with an error, or passes it on late (an API server in trouble, a slow answer).

It serves a certificate of the cluster's CA for 127.0.0.1, so a kubeconfig naming the
proxy instead of the API server, with the same CA and bearer token, works unchanged; the
token travels on to the API server, which authenticates and authorizes as ever. Watches
stream through as they come.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tests.control_plane import ControlPlane, Identity

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass
class Fault:
    """The next `times` requests of `method` whose path (without its query) ends with
    `path`: answered `status` (a Kubernetes Status) when set, else passed on `delay_s`
    late. Set `times = hits` to end it."""

    method: str
    path: str
    status: int | None = None
    delay_s: float = 0.0
    times: int = 1
    hits: int = 0


class KubeProxy:
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        parts = urllib.parse.urlsplit(plane.url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 443)
        self.requests: list[tuple[str, str]] = []
        #: The status each of `requests` was answered, by index; None until answered.
        self.statuses: list[int | None] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPSConnection] = set()
        self._upstream_tls = ssl.create_default_context(cafile=str(plane.work / "ca.crt"))
        folder = plane.work / "kube-proxy"
        folder.mkdir(exist_ok=True)
        serving = plane.ca.issue_cert("127.0.0.1")
        serving.cert_chain_pems[0].write_to_path(str(folder / "tls.crt"))
        serving.private_key_pem.write_to_path(str(folder / "tls.key"))
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(str(folder / "tls.crt"), str(folder / "tls.key"))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def handle(self) -> None:
                try:
                    # The handshake in this request's thread, not the accepting one.
                    self.request.do_handshake()
                    super().handle()
                except OSError:
                    pass  # the client went away, or the proxy stopped under it

            def _handle(self) -> None:
                proxy._forward(self)

            do_GET = do_PUT = do_POST = do_PATCH = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False  # a watch passing through ends when it ends
        self.server.socket = tls.wrap_socket(
            self.server.socket, server_side=True, do_handshake_on_connect=False
        )
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KubeProxy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self._lock:
            for conn in list(self._open):  # ends the watches streaming through
                if conn.sock is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)

    # --- what tests use ------------------------------------------------------------------

    def kubeconfig(self, who: Identity, path: Path) -> Path:
        """`who`'s kubeconfig (a bearer token's) naming this proxy as the server."""
        config: dict[str, Any] = yaml.safe_load(who.kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = self.url
        path.write_text(yaml.safe_dump(config))
        return path

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def count(self, method: str, path: str) -> int:
        """Requests of `method` whose path (without its query) ends with `path`."""
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and _path(p).endswith(path))

    def writes(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(m, p) for m, p in self.requests if m in WRITES]

    # --- forwarding --------------------------------------------------------------------

    def _fault(self, method: str, path: str) -> tuple[int, Fault | None]:
        """The request's index in `requests`, and the fault it meets, if any."""
        with self._lock:
            self.requests.append((method, path))
            self.statuses.append(None)
            index = len(self.requests) - 1
            for fault in self.faults:
                wanted = fault.method == method and _path(path).endswith(fault.path)
                if wanted and fault.hits < fault.times:
                    fault.hits += 1
                    return index, fault
        return index, None

    def _answered(self, index: int, status: int) -> None:
        with self._lock:
            self.statuses[index] = status

    def _forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        index, fault = self._fault(handler.command, handler.path)
        if fault is not None and fault.status is not None:
            self._answered(index, fault.status)
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "message": f"the fault proxy answers {fault.status}",
                "reason": "ServiceUnavailable" if fault.status == 503 else "InternalError",
                "code": fault.status,
            }
            payload = json.dumps(status).encode()
            handler.send_response(fault.status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
            return
        if fault is not None:
            time.sleep(fault.delay_s)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP}
        conn = http.client.HTTPSConnection(*self.upstream, context=self._upstream_tls, timeout=600)
        with self._lock:
            self._open.add(conn)
        try:
            conn.request(handler.command, handler.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            self._answered(index, resp.status)
            handler.send_response(resp.status)
            for key, value in resp.getheaders():
                if key.lower() not in HOP_BY_HOP:
                    handler.send_header(key, value)
            if resp.status in (204, 304):
                handler.end_headers()
                return
            if resp.getheader("Content-Length") is not None:
                data = resp.read()
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)
                return
            # A watch (or any answer of unknown length): passed on chunk by chunk.
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            while chunk := resp.read1(65536):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException):
            # Either side went away (the API server's answer cut mid-chunk when the proxy
            # stops under a watch): so does the other.
            handler.close_connection = True
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()


def _path(path: str) -> str:
    return path.split("?", 1)[0]
