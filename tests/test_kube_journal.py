"""The action journal's codec: what earlier versions wrote decodes, and writes back as it
came."""

from __future__ import annotations

import json
from typing import Any

from supervisor.kube import objects as o
from supervisor.kube.journal import (
    JOURNAL_SIZE,
    JournalEntry,
    Target,
    entry_of,
    journal_of,
    set_journal,
)


def with_journal(value: Any) -> dict[str, Any]:
    return {"metadata": {"annotations": {o.JOURNAL: json.dumps(value, sort_keys=True)}}}


WRITTEN_BEFORE = {
    "restart": {
        "type": "restart_workload",
        "since": "2024-05-01T10:00:00+00:00",
        "restart_attempt": 2,
        "targets": [["train-w-0", "uid-0"], ["train-w-1", "uid-1"]],
        "method": "delete_jobs",
        "why": "no podFailurePolicy",
        "restarts_before": 2,
        "done": True,
        "result": {"method": "delete_jobs", "deleted_jobs": ["train-w-0", "train-w-1"]},
    },
    "swap": {"type": "hot_swap", "targets": [], "skipped": "already restarted", "done": False},
    "heal": {
        "type": "restart_in_place",
        "since": "2024-05-01T10:00:00+00:00",
        "path": "in_process",
        "targets": [["train-w-0-abc", "uid-p"]],
        "world": {"attempt": 1, "master_port": 29501, "at": "", "replaced": ["uid-p"]},
        "fallback": "ranks [3] did not join world 1",
        "done": False,
    },
    "finished-unplanned": {"done": True, "result": {"x": 1}},
}


def test_entries_written_before_decode_and_encode_unchanged() -> None:
    obj = with_journal(WRITTEN_BEFORE)
    journal = journal_of(obj)
    restart = journal["restart"]
    assert restart.done and restart.method == "delete_jobs" and restart.restarts_before == 2
    assert restart.targets == (Target("train-w-0", "uid-0"), Target("train-w-1", "uid-1"))
    assert journal["swap"].targets == () and journal["swap"].skipped == "already restarted"
    assert journal["heal"].world == WRITTEN_BEFORE["heal"]["world"]
    assert journal["finished-unplanned"].type is None
    set_journal(obj, journal)
    assert json.loads(o.annotations_of(obj)[o.JOURNAL]) == WRITTEN_BEFORE


def test_unknown_keys_are_kept_and_entries_that_are_not_objects_dropped() -> None:
    obj = with_journal({"a": {"type": "cordon", "done": False, "later": {"k": 1}}, "b": "junk"})
    journal = journal_of(obj)
    assert list(journal) == ["a"] and journal["a"].extra == {"later": {"k": 1}}
    set_journal(obj, {"a": journal["a"].finished({"ok": True})})
    assert json.loads(o.annotations_of(obj)[o.JOURNAL]) == {
        "a": {"type": "cordon", "done": True, "result": {"ok": True}, "later": {"k": 1}}
    }


def test_unreadable_annotations_read_as_an_empty_journal() -> None:
    assert journal_of({}) == {}
    assert journal_of(with_journal(["not", "an", "object"])) == {}
    bad = {"metadata": {"annotations": {o.JOURNAL: "{not json"}}}
    assert journal_of(bad) == {} and entry_of(bad, "a") is None


def test_the_journal_keeps_its_last_entries() -> None:
    obj: dict[str, Any] = {"metadata": {}}
    entries = {f"k{i:02}": JournalEntry(type="cordon") for i in range(JOURNAL_SIZE + 5)}
    set_journal(obj, entries)
    assert list(journal_of(obj)) == list(entries)[-JOURNAL_SIZE:]
