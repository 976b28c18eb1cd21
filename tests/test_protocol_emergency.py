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


def answer(
    acked: dict[int, dict[str, Any]],
    missing: list[int] | None = None,
    *,
    declined: list[int] | None = None,
    unregistered: list[int] | None = None,
) -> httpx.Response:
    body: dict[str, Any] = {
        "request_id": "k",
        "acked": acked,
        "missing": missing or [],
        "elapsed_s": 0.2,
    }
    if declined is not None:  # left out: as an older host monitor answers
        body["declined"] = declined
    if unregistered is not None:
        body["unregistered"] = unregistered
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


async def test_no_worker_saved_is_no_checkpoint_naming_what_was_looked_at() -> None:
    # No worker was running on a (an older host monitor's answer); b's are still starting.
    result, _ = await run({"a": answer({}), "b": answer({}, unregistered=[2, 3])})
    assert not result.succeeded and not result.takes_none
    assert result.failure == (
        "no worker of the job on a (no live worker), b (ranks 2, 3) is registered with its "
        "host monitor: nothing to save"
    )


async def test_workers_registered_without_emergency_checkpoints_take_none() -> None:
    """Not signalled, so not a failure: the job takes none, naming nodes and ranks."""
    result, _ = await run(
        {"a": answer({}, declined=[0, 1]), "b": answer({}, declined=[2], unregistered=[3])}
    )
    assert result.takes_none and not result.succeeded and result.problems == []
    assert result.none_asked("j") == (
        "job j takes no emergency checkpoints: no worker of it on a (ranks 0, 1), b (ranks "
        "2, 3; rank 3 not registered yet) registered for emergency checkpoints"
    )


async def test_a_job_some_of_whose_workers_take_them_is_judged_on_those() -> None:
    saved, _ = await run({"a": answer({0: ack()}, declined=[1])})
    assert saved.succeeded and not saved.takes_none
    late, _ = await run({"a": answer({}, missing=[0], declined=[1])})
    assert not late.succeeded and not late.takes_none
    assert late.failure == "a: no answer from ranks [0]"
    unreachable, _ = await run({"a": answer({}, declined=[1]), "b": httpx.ConnectError("x")})
    assert not unreachable.takes_none and unreachable.failure == "b: ConnectError: x"


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
