"""An action's status moves by a table, checked where it is written: on SQLite and on
PostgreSQL, a move the table does not have is refused and leaves the row as it was (a
finished action is never reopened, a late write of an older attempt never wins)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from supervisor.domain import ACTION_TRANSITIONS, ActionStatus
from supervisor.policy import actions
from supervisor.store import Store, open_store
from supervisor.store.actions import ActionStatusMove

S = ActionStatus


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    opened = open_store(database_url)
    try:
        yield opened
    finally:
        opened.close()


def test_the_table_has_every_status_and_finished_ones_are_final() -> None:
    assert set(ACTION_TRANSITIONS) == set(ActionStatus)
    for status, moves in ACTION_TRANSITIONS.items():
        assert moves <= set(ActionStatus)
        assert (not moves) == status.finished, status
    assert S.PENDING.may_become(S.RUNNING) and not S.PENDING.may_become(S.SUCCEEDED)


def test_allowed_moves_are_written_and_others_refused_changing_nothing(store: Store) -> None:
    action, created = store.create_action(actions.cordon("n1"), key="k1", source="operator")
    assert created and action.status is S.PENDING and action.id is not None

    # Pending cannot succeed without an attempt.
    with pytest.raises(ActionStatusMove, match="pending -> succeeded"):
        store.finish_action(action.id, S.SUCCEEDED)
    assert store.get_action(action.id).status is S.PENDING  # type: ignore[union-attr]

    running = store.start_attempt(action.id)
    again = store.start_attempt(action.id)  # the next attempt, or one resumed
    assert (running.status, again.status, again.attempts) == (S.RUNNING, S.RUNNING, 2)
    done = store.finish_action(action.id, S.SUCCEEDED, result={"ok": True})
    assert done.status is S.SUCCEEDED

    # Finished: final. A late failure (an older attempt, a replica that lost the lease)
    # and a new attempt are both refused, and the row keeps its outcome.
    with pytest.raises(ActionStatusMove, match="succeeded -> failed"):
        store.finish_action(action.id, S.FAILED, error="late")
    with pytest.raises(ActionStatusMove, match="succeeded -> running"):
        store.start_attempt(action.id)
    kept = store.get_action(action.id)
    assert kept is not None
    assert (kept.status, kept.error, kept.result, kept.attempts) == (
        S.SUCCEEDED,
        None,
        {"ok": True},
        2,
    )

    # A pending action may fail without an attempt (none left).
    other, _ = store.create_action(actions.cordon("n2"), key="k2", source="operator")
    assert other.id is not None
    assert store.finish_action(other.id, S.FAILED, error="no attempts left").status is S.FAILED
