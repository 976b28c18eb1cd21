"""The journal of our actions on an object, kept in its annotation
`resiliency.supervisor.io/actions`: per action key, what was decided (before acting) and
whether it is done, with its result. A retried action reads its entry and does not decide
again; it is written together with the change it plans (one optimistic write).

The annotation is a JSON object, action key -> entry; an entry is `JournalEntry` and its
codec (`to_json`, `from_json`). The JSON names are the record's field names: entries
written by earlier versions decode as they are, keys this version does not know are kept
(`extra`) and written back, entries that are not JSON objects are dropped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from supervisor.kube import objects as o
from supervisor.kube.objects import Obj

#: Journal entries kept per object (the newest).
JOURNAL_SIZE = 20


class Target(NamedTuple):
    """A pod or Job an action acts on: by name, and by UID (a replacement is left alone)."""

    name: str
    uid: str


def target_of(obj: Obj) -> Target:
    return Target(o.name_of(obj), o.uid_of(obj))


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalEntry:
    """One action's entry. Fields left None are absent from the JSON."""

    #: The action's type (`ActionType.value`); None only on an entry finished without
    #: having been planned (its plan dropped from a full journal meanwhile).
    type: str | None = None
    done: bool = False
    #: What `execute` answered; a repeat of a done action answers it again.
    result: Mapping[str, Any] | None = None
    #: The reference time the action was decided against (ISO 8601), for people.
    since: str | None = None
    #: The JobSet's restart attempt at that time (generations.Generation.at_event).
    restart_attempt: int | None = None
    #: Why the action does nothing: the JobSet restarted or healed since.
    skipped: str | None = None
    #: The pods or Jobs chosen to act on.
    targets: tuple[Target, ...] | None = None
    #: In-process heal: the Jobs of one pod each, among the targets', that are recreated
    #: (deleted for the JobSet controller to create again), not left to replace the pod.
    jobs: tuple[Target, ...] | None = None
    #: restart_workload: "evict" (a JobSet restart) or "delete_jobs", and why not evict.
    method: str | None = None
    why: str | None = None
    #: restart_workload: the JobSet's status.restarts when planned.
    restarts_before: int | None = None
    #: In-process heal: its path ("in_process"), the world it moves the JobSet to
    #: (worlds.World as a dict), and why it turned into a full restart.
    path: str | None = None
    world: Mapping[str, Any] | None = None
    fallback: str | None = None
    #: Keys of another version of the supervisor, written back as they came.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def finished(self, result: Mapping[str, Any]) -> JournalEntry:
        return dataclasses.replace(self, done=True, result=dict(result))

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            item = getattr(self, f.name)
            if f.name == "extra" or (item is None and f.name != "done"):
                continue
            if f.name in TARGET_LISTS:
                item = [list(t) for t in item]
            elif isinstance(item, Mapping):
                item = dict(item)
            value[f.name] = item
        return value

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> JournalEntry:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        fields: dict[str, Any] = {k: v for k, v in value.items() if k in known}
        fields["done"] = bool(fields.get("done"))
        for name in TARGET_LISTS:
            if (targets := fields.get(name)) is not None:
                fields[name] = tuple(Target(str(n), str(uid)) for n, uid in targets)
        extra = {k: v for k, v in value.items() if k not in known}
        return cls(**fields, extra=extra)


#: The fields that hold targets, written as [name, uid] pairs.
TARGET_LISTS = ("targets", "jobs")


def journal_of(obj: Obj) -> dict[str, JournalEntry]:
    """The object's journal, in the annotation's order (empty if unreadable)."""
    try:
        value = json.loads(o.annotations_of(obj).get(o.JOURNAL, "{}"))
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {
        key: JournalEntry.from_json(entry)
        for key, entry in value.items()
        if isinstance(entry, dict)
    }


def entry_of(obj: Obj, key: str) -> JournalEntry | None:
    return journal_of(obj).get(key)


def set_journal(obj: Obj, journal: Mapping[str, JournalEntry]) -> None:
    keep = list(journal.items())[-JOURNAL_SIZE:]
    encoded = {key: entry.to_json() for key, entry in keep}
    o.meta(obj).setdefault("annotations", {})[o.JOURNAL] = json.dumps(encoded, sort_keys=True)
