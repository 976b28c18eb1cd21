"""The answers given to the actuator's latest requests, by request id: a request sent
again gets the same answer instead of acting twice (idempotency)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from host_monitor.workers import WorkerConflict

KEEP_REQUESTS = 64  # request ids remembered, of each kind

_Request = TypeVar("_Request")
_Result = TypeVar("_Result")


class AnsweredRequests(Generic[_Request, _Result]):
    """The last KEEP_REQUESTS requests of one kind (`what`: "start", "rejoin", ...) and
    their answers."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._done: OrderedDict[str, tuple[_Request, _Result]] = OrderedDict()

    def answered(self, request_id: str, req: _Request) -> _Result | None:
        """The answer already given to `request_id`, or None; the same id with another
        request is a conflict."""
        seen = self._done.get(request_id)
        if seen is None:
            return None
        if seen[0] != req:
            raise WorkerConflict(f"request_id {request_id!r} was used for a different {self._what}")
        return seen[1]

    def remember(self, request_id: str, req: _Request, result: _Result) -> None:
        self._done[request_id] = (req, result)
        while len(self._done) > KEEP_REQUESTS:
            self._done.popitem(last=False)
