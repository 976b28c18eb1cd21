"""The client's ApiException translated into the package's errors: the type by status, the
Status body's reason and message, Retry-After, and whether an action may try again."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from supervisor.kube.errors import (
    ApiError,
    Conflict,
    Gone,
    KubeConfigError,
    KubeError,
    NotFound,
    ServerError,
    TooManyRequests,
    api_error,
    status_error,
)


def api_exception(
    status: int, reason: str, body: object = None, headers: dict[str, str] | None = None
) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps(body) if body is not None else None
    exc.headers = headers
    return exc


@pytest.mark.parametrize(
    ("status", "cls", "retryable"),
    [
        (404, NotFound, False),
        (409, Conflict, True),
        (410, Gone, False),
        (429, TooManyRequests, True),
        (500, ServerError, True),
        (503, ServerError, True),
        (501, ServerError, False),
        (403, ApiError, False),
        (422, ApiError, False),
    ],
)
def test_the_type_and_retryable_follow_the_status(
    status: int, cls: type[ApiError], retryable: bool
) -> None:
    error = api_error(api_exception(status, "Phrase"), "get pod p")
    assert type(error) is cls and isinstance(error, KubeError)
    assert error.status == status and error.retryable is retryable


def test_the_status_body_gives_reason_and_message_and_the_header_the_wait() -> None:
    body = {"kind": "Status", "reason": "TooManyRequests", "message": "Cannot evict pod"}
    exc = api_exception(429, "Too Many Requests", body, {"Retry-After": "3"})
    error = api_error(exc, "evict pod p")
    assert (error.reason, error.message, error.retry_after) == (
        "TooManyRequests",
        "Cannot evict pod",
        3.0,
    )
    assert str(error) == "evict pod p: HTTP 429 TooManyRequests: Cannot evict pod"


def test_not_found_and_conflict_say_the_request_and_the_message() -> None:
    body = {"reason": "NotFound", "message": 'jobsets "nope" not found'}
    assert str(api_error(api_exception(404, "Not Found", body), "get jobset nope")) == (
        'get jobset nope: jobsets "nope" not found'
    )


def test_without_a_status_body_the_http_reason_phrase_stands_in() -> None:
    error = api_error(api_exception(502, "Bad Gateway", headers={"Retry-After": "soon"}), "x")
    assert (error.reason, error.message, error.retry_after) == ("Bad Gateway", "Bad Gateway", None)


def test_a_watch_error_event_is_translated_from_its_status() -> None:
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    error = status_error("watch Pod", 410, status)
    assert isinstance(error, Gone) and error.reason == "Expired"


def test_a_configuration_error_is_a_kube_error_and_a_runtime_error() -> None:
    assert issubclass(KubeConfigError, KubeError) and issubclass(KubeConfigError, RuntimeError)
