"""Attaching an event to the incident of a remedy already decided: the event is marked
handled, with no action of its own, naming the remedy; the remedy lists it; and a node
failure it counted against its node is taken back (the incident counts once). One
transaction, idempotent (an event already handled is left as it is)."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from supervisor.domain import NODE_FAILURE_EVENTS, Event, EventType, utcnow
from supervisor.store.models import ActionRow, CounterRow, EventRow
from supervisor.xid import blames_node


def attach_event(
    sessions: sessionmaker[Session],
    event_id: int,
    action_id: int,
    *,
    failures: tuple[str, str],
) -> bool:
    """Attach event `event_id` to the incident of action `action_id`; False when the event
    was handled already (then nothing changes). `failures`: the (scope, name) of the
    node failure counters. KeyError for an unknown event or action."""
    with sessions.begin() as session:
        event = session.get(EventRow, event_id, with_for_update=True)
        action = session.get(ActionRow, action_id, with_for_update=True)
        if event is None or action is None:
            raise KeyError(event_id if event is None else action_id)
        if event.handled_at is not None:
            return False
        now = utcnow()
        event.handled_at = now
        event.incident_action_id = action_id
        action.attached_events = [*(action.attached_events or ()), event_id]
        seen = Event(EventType(event.type), event.time, node=event.node, details=event.details)
        if event.node and seen.type in NODE_FAILURE_EVENTS and blames_node(seen):
            scope, name = failures
            counter = session.get(CounterRow, (scope, event.node, name), with_for_update=True)
            if counter is not None and counter.value > 0:
                counter.value -= 1
                counter.updated_at = now
        return True
