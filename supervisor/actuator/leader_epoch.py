"""The acting supervisor's epoch on every command a backend sends to host monitors, and a
host monitor's refusal of an older one read as `Fenced` (resiliency_protocol/leaders.py)."""

from __future__ import annotations

import httpx

from resiliency_protocol.leaders import LEADER_EPOCH_HEADER, stale_leader_of
from supervisor.actuator.backend import Fenced


def stamp(http: httpx.AsyncClient, epoch: int | None) -> None:
    """Send `epoch` with every request of `http` (None: this supervisor takes none, e.g.
    a dry run, and sends none)."""
    if epoch is None:
        return
    http.headers[LEADER_EPOCH_HEADER] = str(epoch)
    hooks = http.event_hooks
    if _refused_as_stale not in hooks["response"]:
        hooks["response"].append(_refused_as_stale)
        http.event_hooks = hooks


async def _refused_as_stale(response: httpx.Response) -> None:
    if response.status_code != 409:
        return
    await response.aread()
    refused = stale_leader_of(response.content)
    if refused is not None:
        raise Fenced(f"host monitor at {response.request.url.netloc.decode()}: {refused.message}")
