"""The emergency checkpoint across nodes (resiliency_protocol.emergency): the one rule of
success, against host monitors faked with httpx's mock transport."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from resiliency_protocol.emergency import PATH, EmergencyCheckpoint, emergency_checkpoint


def ack(ok: bool = True, step: int | None = 7, error: str | None = None) -> dict[str, Any]:
    return {"request_id": "k", "ok": ok, "step": step, "duration_s": 0.1, "error": error}


def answer(acked: dict[int, dict[str, Any]], missing: list[int] | None = None) -> httpx.Response:
    body = {"request_id": "k", "acked": acked, "missing": missing or [], "elapsed_s": 0.2}
    return httpx.Response(200, json=body)


async def run(
    answers: dict[str, httpx.Response | Exception], hosts: dict[str, str | None] | None = None
) -> tuple[EmergencyCheckpoint, list[httpx.Request]]:
    """Ask nodes whose host monitor at http://<node> answers as `answers` says."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        reply = answers[request.url.host]
        if isinstance(reply, Exception):
            raise reply
        return reply

    hosts = hosts if hosts is not None else {node: f"http://{node}/" for node in answers}
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        result = await emergency_checkpoint(
            http, hosts, request_id="k", timeout_s=3.0, http_timeout_s=5.0
        )
    return result, seen


async def test_every_worker_saved_succeeds_and_says_what_was_saved() -> None:
    result, seen = await run(
        {"a": answer({0: ack(step=7)}), "b": answer({1: ack(step=8), 2: ack(step=None)})}
    )
    assert result.succeeded and result.problems == []
    assert result.saved == {0: 7, 1: 8, 2: None} and result.steps == [7, 8]
    assert [o.node for o in result.nodes] == ["a", "b"]
    assert {r.url.path for r in seen} == {PATH}
    assert json.loads(seen[0].content) == {"request_id": "k", "timeout_s": 3.0}


@pytest.mark.parametrize(
    ("b", "problem"),
    [
        (answer({1: ack()}, missing=[2]), "b: no answer from ranks [2]"),
        (answer({1: ack(ok=False, step=None, error="disk full")}), "b: rank 1 failed: disk full"),
        (httpx.Response(503, json={"message": "stopping", "detail": "x"}), "b: HTTP 503: stopping"),
        (httpx.ConnectError("refused"), "b: ConnectError: refused"),
    ],
    ids=["late", "failed", "error-answer", "unreachable"],
)
async def test_one_node_or_worker_short_fails_it_naming_them(
    b: httpx.Response | Exception, problem: str
) -> None:
    result, _ = await run({"a": answer({0: ack()}), "b": b})
    assert not result.succeeded
    assert result.problems == [problem] and result.failure == problem
    assert 0 in result.saved  # what was saved is still said


async def test_no_worker_saved_is_no_checkpoint() -> None:
    result, _ = await run({"a": answer({})})  # no worker was running there
    assert not result.succeeded and result.failure == "no worker acked"


async def test_a_node_without_an_address_is_not_asked_and_fails_it() -> None:
    result, seen = await run({"a": answer({0: ack()})}, {"a": "http://a", "b": None})
    assert [r.url.host for r in seen] == ["a"]
    assert result.problems == ["b: no address for the host monitor of b"]
    assert not result.succeeded


async def test_what_before_each_raises_is_that_nodes_outcome() -> None:
    class Fenced(Exception):
        pass

    def fence() -> None:
        raise Fenced("not the leader")

    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: answer({}))) as http:
        result = await emergency_checkpoint(
            http,
            {"a": "http://a"},
            request_id="k",
            timeout_s=1,
            http_timeout_s=2,
            before_each=fence,
        )
    assert result.problems == ["a: Fenced: not the leader"]
