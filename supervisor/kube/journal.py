"""The journal of our actions on an object, kept in its annotation
`resiliency.supervisor.io/actions`: per action key, what was decided (before acting) and
whether it is done, with its result. A retried action reads its entry and does not decide
again; it is written together with the change it plans (one optimistic write)."""

from __future__ import annotations

import json
from typing import Any

from supervisor.kube import objects as o
from supervisor.kube.objects import Obj

#: Journal entries kept per object (the newest).
JOURNAL_SIZE = 20


def journal_of(obj: Obj) -> dict[str, Any]:
    try:
        value = json.loads(o.annotations_of(obj).get(o.JOURNAL, "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def set_journal(obj: Obj, journal: dict[str, Any]) -> None:
    keep = dict(list(journal.items())[-JOURNAL_SIZE:])
    o.meta(obj).setdefault("annotations", {})[o.JOURNAL] = json.dumps(keep, sort_keys=True)
