"""`host-monitor relay`: carries the heartbeats of a rack's host monitors to the supervisor
in batches (`POST /api/v1/heartbeats/batch`, resiliency_protocol/heartbeat_batch.py).

Host monitors with `heartbeat_relay_url` send it their heartbeats exactly as they would
the supervisor's `POST /api/v1/heartbeats` (the node's own credential, the same body).
The relay holds each request, sends what came within `interval_s` (100 ms by default, or
as soon as a batch is full) as one request with its own credential, and answers each
host monitor with the supervisor's result for its heartbeat: the status, world header and
body the single route would have answered. It keeps nothing but the requests in flight,
and reads no heartbeat: the supervisor checks each node's credential against its node.

When the supervisor cannot be reached, or refuses the relay itself, each request held is
answered 502: the host monitor then sends that heartbeat directly (host_monitor/
heartbeat.py), as it does when the relay is down, so a relay is never why a node is
declared lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import uvicorn
from starlette.types import Receive, Scope, Send

from host_monitor.credentials import BearerCredential, CredentialError
from resiliency_protocol.error_reading import error_message
from resiliency_protocol.heartbeat_batch import (
    BATCH_PATH,
    MAX_BATCH,
    MAX_CREDENTIAL,
    HeartbeatResult,
    encode_batch,
    parse_answer,
)
from resiliency_protocol.logs import configure_logging
from resiliency_protocol.tls import TLSError, client_context
from resiliency_protocol.worlds import JOB_WORLD_HEADER

log = logging.getLogger(__name__)

HEARTBEATS_PATH = "/api/v1/heartbeats"
#: The single route's bound on a heartbeat's body (supervisor/api/routes/heartbeats.py).
MAX_BODY = 1 << 20
#: Answered to each held heartbeat when its batch did not get an answer: send it directly.
UPSTREAM_FAILED = 502


_raw_json = msgspec.json.Decoder(msgspec.Raw)


@dataclass
class _Held:
    token: str
    body: bytes
    answer: asyncio.Future[HeartbeatResult] = field(repr=False)


class HeartbeatRelay:
    """The relay's ASGI app and its sender task (`run`)."""

    def __init__(
        self,
        supervisor_url: str,
        credential: str | BearerCredential,
        interval_s: float = 0.1,
        timeout_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context`: how an https:// supervisor is verified (default: the system's
        trust store)."""
        self.url = supervisor_url.rstrip("/") + BATCH_PATH
        self._ssl = ssl_context if ssl_context is not None else client_context()
        self._credential = BearerCredential.of(credential)
        self.interval_s = interval_s
        self._timeout = httpx.Timeout(timeout_s, connect=1.0)
        self._held: list[_Held] = []
        self._ready = asyncio.Event()
        self.batches = 0  # sent and answered, for /healthz and tests
        self.heartbeats = 0  # in those batches

    # --- the host monitors' side ----------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            counts = {"status": "ok", "batches": self.batches, "heartbeats": self.heartbeats}
            await _answer(send, 200, json.dumps(counts).encode())
            return
        if scope["path"] != HEARTBEATS_PATH or scope["method"] != "POST":
            await _answer(send, 404, _error("the relay takes POST /api/v1/heartbeats only"))
            return
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].decode("latin-1")
        if not token or len(token) > MAX_CREDENTIAL:
            await _answer(send, 401, _error("missing or invalid bearer token"))
            return
        body = await _read_body(receive)
        if body is None:
            await _answer(send, 413, _error(f"body larger than {MAX_BODY} bytes"))
            return
        try:
            # What is not JSON would spoil the whole batch: refused here, alone. The rest
            # of the checks are the supervisor's.
            body = bytes(_raw_json.decode(body))
        except msgspec.DecodeError as exc:
            await _answer(send, 422, _error(f"body: invalid JSON: {exc}"))
            return
        held = _Held(token, body, asyncio.get_running_loop().create_future())
        self._held.append(held)
        self._ready.set()
        result = await held.answer
        headers = (
            [] if result.world is None else [(JOB_WORLD_HEADER.encode(), b"%d" % result.world)]
        )
        await _answer(send, result.status, bytes(result.body) or None, headers)

    # --- the supervisor's side ------------------------------------------------------------

    async def run(self) -> None:
        """Send what is held, a batch per interval, until cancelled."""
        async with httpx.AsyncClient(timeout=self._timeout, verify=self._ssl) as client:
            while True:
                await self._ready.wait()
                if len(self._held) < MAX_BATCH:
                    await asyncio.sleep(self.interval_s)
                batch, self._held = self._held[:MAX_BATCH], self._held[MAX_BATCH:]
                if not self._held:
                    self._ready.clear()
                await self._send(client, batch)

    async def _send(self, client: httpx.AsyncClient, batch: list[_Held]) -> None:
        results = await self._results(client, batch)
        if isinstance(results, str):
            log.warning("batch of %d heartbeats not delivered (%s)", len(batch), results)
            failed = HeartbeatResult(
                UPSTREAM_FAILED,
                body=msgspec.Raw(_error(f"relay: supervisor not reached: {results}")),
            )
            results = [failed] * len(batch)
        else:
            self.batches += 1
            self.heartbeats += len(batch)
        for held, result in zip(batch, results, strict=True):
            if not held.answer.done():
                held.answer.set_result(result)

    async def _results(
        self, client: httpx.AsyncClient, batch: list[_Held]
    ) -> list[HeartbeatResult] | str:
        """The supervisor's result for each heartbeat of `batch`; else why there is none."""
        try:
            response = await client.post(
                self.url,
                content=encode_batch([(h.token, h.body) for h in batch]),
                headers={
                    "Authorization": self._credential.header(),
                    "Content-Type": "application/json",
                },
            )
        except (httpx.HTTPError, CredentialError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if response.status_code == 401:
            self._credential.refresh()  # rotated meanwhile: read it again
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {error_message(response)}"
        try:
            results = parse_answer(response.content).results
        except ValueError as exc:
            return str(exc)
        if len(results) != len(batch):
            return f"{len(results)} results for {len(batch)} heartbeats"
        return results


def _error(message: str) -> bytes:
    return json.dumps({"message": message, "detail": message}).encode()


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _answer(
    send: Send, status: int, body: bytes | None, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    head = list(headers or [])
    if body is not None:
        head += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body or b""})


# --- the command --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="host-monitor relay",
        description="Carries a rack's heartbeats to the supervisor in batches.",
    )
    parser.add_argument("--supervisor-url", required=True, help="Base URL of the supervisor.")
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=9310, help="Port to listen on.")
    parser.add_argument(
        "--credential-file",
        required=True,
        help="The relay's own credential (an agent credential the supervisor accepts), "
        "read again when it rotates.",
    )
    parser.add_argument(
        "--interval-ms", type=float, default=100.0, help="Longest a heartbeat is held."
    )
    parser.add_argument(
        "--ca-file",
        default=None,
        help="CA (PEM) an https supervisor's certificate is checked with.",
    )
    return parser


async def _serve(args: argparse.Namespace) -> None:
    relay = HeartbeatRelay(
        args.supervisor_url,
        BearerCredential(path=Path(args.credential_file)),
        interval_s=args.interval_ms / 1000,
        ssl_context=client_context(args.ca_file),
    )
    config = uvicorn.Config(
        relay, host=args.host, port=args.port, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    sender = asyncio.create_task(relay.run(), name="heartbeat-relay")
    try:
        await server.serve()
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.interval_ms <= 0 or args.interval_ms > 1000:
        print("host-monitor relay: --interval-ms: between 0 and 1000", file=sys.stderr)
        raise SystemExit(2)
    configure_logging("info", "text", fixed={"role": "heartbeat-relay"})
    try:
        asyncio.run(_serve(args))
    except TLSError as exc:
        print(f"host-monitor relay: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
