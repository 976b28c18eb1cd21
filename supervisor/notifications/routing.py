"""Which routes a notice goes to.

A route takes a notice when each of its matchers does: an event whose type it lists
(or "*"), or a finished action whose type it lists (or "*") and whose outcome it lists;
and, when it names jobs, one of those jobs. An Alertmanager route also takes the events
that clear what it alerts on (node_recovered for host_heartbeat_lost, ...), so that the
alert it raised is resolved.
"""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.config_parts.notification_routes import ANY, Route
from supervisor.domain import EventType
from supervisor.notices import CLEARS, Notice


def routes_for(notice: Notice, routes: Sequence[Route]) -> list[Route]:
    return [route for route in routes if matches(route, notice)]


def matches(route: Route, notice: Notice) -> bool:
    if route.jobs and notice.job not in route.jobs:
        return False
    if selects(route, notice):
        return True
    if notice.kind == "action" or route.sink.type != "alertmanager":
        return False
    cleared = CLEARS.get(EventType(notice.type), frozenset())
    return any(_listed(t.value, route.events) for t in cleared)


def selects(route: Route, notice: Notice) -> bool:
    """The route asks for this notice itself (not only for what it clears); jobs aside."""
    if notice.kind == "action":
        return _listed(notice.type, route.actions) and notice.outcome in route.outcomes
    return _listed(notice.type, route.events)


def _listed(type_: str, listed: Sequence[str]) -> bool:
    return ANY in listed or type_ in listed
