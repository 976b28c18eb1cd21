"""What the bare ASGI apps that take heartbeats share: a body read whole up to a bound, and
a JSON answer. They skip a framework's routing and middleware, which cost more than a
heartbeat (the supervisor's heartbeat routes, supervisor/api/routes/heartbeats.py and
heartbeat_batch.py; `host-monitor relay`, host_monitor/relay.py).

Standard library only (the ASGI types are written out, as the servers' own are), and
imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from resiliency_protocol.errors import error_body

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

_JSON = (b"content-type", b"application/json")
_BEARER = [(b"www-authenticate", b"Bearer")]


async def body_within(
    receive: Receive, send: Send, limit: int, first: Message | None = None
) -> bytes | None:
    """The whole request body, `first` being its first part when already received; None
    once it exceeds `limit` bytes (the rest is not read), answered 413 then."""
    message = first if first is not None else await receive()
    chunks = [message.get("body", b"")]
    size = len(chunks[0])
    while size <= limit and message.get("more_body", False):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
    if size > limit:
        await send_error(send, 413, f"body larger than {limit} bytes")
        return None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_json(
    send: Send, status: int, body: bytes | None, headers: Headers | None = None
) -> None:
    """An answer with `body`, JSON (None: no body, as a 204's)."""
    head = list(headers or ())
    if body is not None:
        head += [_JSON, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body or b""})


async def send_error(send: Send, status: int, message: str, headers: Headers | None = None) -> None:
    """An error answer, with the body of every route (`ErrorOut`): `message`, and
    `detail` as FastAPI's."""
    await send_json(send, status, json.dumps(error_body(message, message)).encode(), headers)


async def refuse_credential(send: Send, message: str) -> None:
    """401, naming the scheme a request must authenticate with."""
    await send_error(send, 401, message, _BEARER)


def bearer_and_type(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
    """A request's bearer token (the scheme is case-insensitive, RFC 9110) and its
    Content-Type; None for either that is not there."""
    token = content_type = None
    for name, value in headers:
        if name == b"authorization":
            if value[:7].lower() == b"bearer ":
                token = value[7:]
        elif name == b"content-type":
            content_type = value
    return token, content_type
