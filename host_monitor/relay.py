"""`host-monitor relay`: carries the heartbeats of a rack's host monitors to the supervisor
in batches (`POST /api/v1/heartbeats/batch`, resiliency_protocol/heartbeat_batch.py).

Host monitors with `heartbeat_relay_url` send it their heartbeats exactly as they would
the supervisor's `POST /api/v1/heartbeats` (the node's own credential, the same body).
The relay holds each request, sends what came within `interval_s` (100 ms by default, or
as soon as a batch is full, or at once for a heartbeat marked urgent: a worker's state
change or a GPU report) as one request with its own credential, and answers each
host monitor with the supervisor's result for its heartbeat: the status, world header and
body the single route would have answered. It keeps nothing but the requests in flight,
and reads no heartbeat: the supervisor checks each node's credential against its node.

When the supervisor cannot be reached, or refuses the relay itself, each request held is
answered 502: the host monitor then sends that heartbeat directly (host_monitor/
heartbeat.py), as it does when the relay is down, so a relay is never why a node is
declared lost.

With `--tls-cert-file` and `--tls-key-file` (the host monitor's TLS settings, by the same
names) it serves HTTPS: host monitors verify it with their `tls_ca_file`, and one that
cannot sends its heartbeats directly, as above.
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
from resiliency_protocol.bare_asgi import (
    bearer_and_type,
    body_within,
    refuse_credential,
    send_error,
    send_json,
)
from resiliency_protocol.error_reading import error_message
from resiliency_protocol.errors import error_body
from resiliency_protocol.heartbeat import HEARTBEAT_PATH, MAX_HEARTBEAT_BODY_BYTES, URGENT_HEADER
from resiliency_protocol.heartbeat_batch import (
    BATCH_PATH,
    MAX_BATCH,
    MAX_CREDENTIAL,
    HeartbeatResult,
    encode_batch,
    parse_answer,
    refused,
)
from resiliency_protocol.logs import configure_logging
from resiliency_protocol.shared_settings import SERVER_KEEP_ALIVE_S
from resiliency_protocol.tls import TLSError, client_context, half_key_pair, server_context
from resiliency_protocol.worlds import job_world_header

log = logging.getLogger(__name__)

#: Answered to each held heartbeat when its batch did not get an answer: send it directly.
UPSTREAM_FAILED = 502


_raw_json = msgspec.json.Decoder(msgspec.Raw)
_URGENT = (URGENT_HEADER.encode(), b"1")  # as ASGI gives a header: name lower case


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
        self._now = asyncio.Event()  # an urgent heartbeat is held: send without waiting
        self.batches = 0  # sent and answered, for /healthz and tests
        self.heartbeats = 0  # in those batches
        self.urgent = 0  # heartbeats marked urgent, each sent without waiting

    def counts(self) -> dict[str, int | str]:
        """What `/healthz` answers: heartbeats delivered, urgent ones, and held now."""
        return {
            "status": "ok",
            "batches": self.batches,
            "heartbeats": self.heartbeats,
            "urgent": self.urgent,
            "held": len(self._held),
        }

    # --- the host monitors' side ----------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            await send_json(send, 200, json.dumps(self.counts()).encode())
            return
        if scope["path"] != HEARTBEAT_PATH or scope["method"] != "POST":
            await send_error(send, 404, "the relay takes POST /api/v1/heartbeats only")
            return
        bearer, _ = bearer_and_type(scope["headers"])
        token = None if bearer is None else bearer.decode("latin-1")
        if not token or len(token) > MAX_CREDENTIAL:
            await refuse_credential(send, "missing or invalid bearer token")
            return
        body = await body_within(receive, send, MAX_HEARTBEAT_BODY_BYTES)
        if body is None:
            return
        try:
            # What is not JSON would spoil the whole batch: refused here, alone. The rest
            # of the checks are the supervisor's.
            body = bytes(_raw_json.decode(body))
        except msgspec.DecodeError as exc:
            await send_error(send, 422, f"body: invalid JSON: {exc}")
            return
        held = _Held(token, body, asyncio.get_running_loop().create_future())
        self._held.append(held)
        self._ready.set()
        if _URGENT in scope["headers"]:
            self.urgent += 1
            self._now.set()
        result = await held.answer
        headers = [] if result.world is None else [job_world_header(result.world)]
        body = None if result.body is msgspec.UNSET else bytes(result.body)
        await send_json(send, result.status, body, headers)

    # --- the supervisor's side ------------------------------------------------------------

    async def run(self) -> None:
        """Send what is held, a batch per interval, until cancelled."""
        async with httpx.AsyncClient(timeout=self._timeout, verify=self._ssl) as client:
            while True:
                await self._ready.wait()
                if len(self._held) < MAX_BATCH and not self._now.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._now.wait(), self.interval_s)
                self._now.clear()
                batch, self._held = self._held[:MAX_BATCH], self._held[MAX_BATCH:]
                if not self._held:
                    self._ready.clear()
                await self._send(client, batch)

    async def _send(self, client: httpx.AsyncClient, batch: list[_Held]) -> None:
        results = await self._results(client, batch)
        if isinstance(results, str):
            log.warning("batch of %d heartbeats not delivered (%s)", len(batch), results)
            message = f"relay: supervisor not reached: {results}"
            results = [refused(UPSTREAM_FAILED, error_body(message, message))] * len(batch)
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
    # The host monitor's TLS settings, as flags of the same names (docs/security.md, "TLS").
    tls = parser.add_argument_group("TLS")
    tls.add_argument(
        "--tls-cert-file",
        help="Certificate (PEM, its chain after it) the relay presents: with --tls-key-file, "
        "it serves HTTPS, and host monitors verify it with their tls_ca_file. Unset: HTTP.",
    )
    tls.add_argument("--tls-key-file", help="Private key (PEM) of --tls-cert-file.")
    tls.add_argument(
        "--tls-ca-file",
        "--ca-file",
        dest="tls_ca_file",
        help="CA bundle (PEM) that verifies an https supervisor. Unset: the system's trust store.",
    )
    return parser


def _supervisor_tls(args: argparse.Namespace) -> ssl.SSLContext:
    """Reads the TLS files now (start-up): how the supervisor is verified. Raises TLSError
    naming the flag."""
    flags = {"cert_name": "--tls-cert-file", "key_name": "--tls-key-file"}
    if half := half_key_pair(args.tls_cert_file, args.tls_key_file, **flags):
        raise TLSError(half)
    if args.tls_cert_file is not None:
        server_context(args.tls_cert_file, args.tls_key_file, **flags)
    return client_context(args.tls_ca_file, ca_name="--tls-ca-file")


async def _serve(args: argparse.Namespace, supervisor_tls: ssl.SSLContext) -> None:
    relay = HeartbeatRelay(
        args.supervisor_url,
        BearerCredential(path=Path(args.credential_file)),
        interval_s=args.interval_ms / 1000,
        ssl_context=supervisor_tls,
    )
    config = uvicorn.Config(
        relay,
        host=args.host,
        port=args.port,
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        ssl_certfile=args.tls_cert_file,
        ssl_keyfile=args.tls_key_file,
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
    try:
        if args.interval_ms <= 0 or args.interval_ms > 1000:
            raise ValueError("--interval-ms: between 0 and 1000")
        supervisor_tls = _supervisor_tls(args)
    except (ValueError, TLSError) as exc:
        print(f"host-monitor relay: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging("info", "text", fixed={"role": "heartbeat-relay"})
    asyncio.run(_serve(args, supervisor_tls))


if __name__ == "__main__":
    main()
