"""Live updates as server-sent events: every event recorded and every change of an
action, as the REST API shows them.

- `event: event` / `event: action`: data is the EventOut / ActionOut JSON; `id` is the
  hub's message id. Send the last one seen back as `Last-Event-ID` on reconnect to
  get what was missed.
- `event: resync`: what was missed cannot be given (first connection, the server was
  restarted, the gap is too old, or this reader fell too far behind): reload from the
  REST API; the stream goes on from here.
- A comment line every `KEEPALIVE_S` keeps proxies from closing an idle stream and
  lets readers notice a dead one. A reader that goes away is noticed by the server
  (Starlette cancels the response), and its subscription ends with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import StreamingResponse

from supervisor.api.deps import Reader
from supervisor.api.parts import LiveHub
from supervisor.api.schemas import ActionOut, EventOut
from supervisor.domain import ActionRecord, Event
from supervisor.live_hub import Hub, Item, Message

router = APIRouter(prefix="/api/v1", tags=["stream"], dependencies=[Reader])

KEEPALIVE_S = 15.0


def encode(item: Event | ActionRecord) -> str:
    if isinstance(item, Event):
        return EventOut.of(item).model_dump_json()
    return ActionOut.of(item).model_dump_json()


def frame(item: Item) -> str:
    if isinstance(item, Message):
        return f"id: {item.id}\nevent: {item.kind}\ndata: {item.encoded(encode)}\n\n"
    return f'id: {item.id}\nevent: resync\ndata: {{"id": "{item.id}"}}\n\n'


async def frames(hub: Hub, last_event_id: str | None) -> AsyncIterator[str]:
    subscription, first = hub.subscribe(last_event_id)
    try:
        yield "retry: 1000\n" + "".join(frame(i) for i in first)
        while not subscription.closed:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    await subscription.wait()
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            chunk = "".join(frame(i) for i in subscription.drain())
            if chunk:
                yield chunk
    finally:
        hub.unsubscribe(subscription)


@router.get(
    "/stream",
    summary="Live events and action changes (text/event-stream)",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def stream(
    hub: LiveHub,
    last_event_id: Annotated[
        str | None,
        Header(max_length=64, description="Last message id seen: replay what came after."),
    ] = None,
) -> StreamingResponse:
    return StreamingResponse(
        frames(hub, last_event_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
