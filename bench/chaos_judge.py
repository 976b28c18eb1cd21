"""How the chaos run judges one fault, from the supervisor's actions: the same rule for
the supervisor's own faults (bench/chaos.py) and the network's (bench/chaos_network.py).

A fault is healed when its last remedy (an action other than an emergency checkpoint)
succeeded, or, where that remedy failed, when a later remedy of the same job succeeded
within `LATER_REMEDY_S` of the failure: two faults landing together can leave the first
remedy nothing to start on (its spare was the node downed a moment later), and the next
remedy heals the job for both. Which later action healed it is told, never hidden. An
emergency checkpoint that did not commit is listed apart, with its error: it is reported
to the operator and fails no remedy that went on to heal the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

#: A failed remedy's fault still counts as healed when a later remedy of the same job
#: succeeded within this many seconds of the failure.
LATER_REMEDY_S = 60.0
CHECKPOINT = "emergency_checkpoint"
FINISHED = ("succeeded", "failed")

__all__ = ["LATER_REMEDY_S", "Judgement", "judge", "timestamp"]


@dataclass
class Judgement:
    healed: bool = True
    #: Why not: "an action still open", or each failed remedy's "type: error".
    why_not: str | None = None
    #: The later remedy that healed the job after this fault's own failed: "type #id".
    healed_by: str | None = None
    checkpoints_not_committed: list[str] = field(default_factory=list)


def judge(mine: list[dict[str, Any]], later: list[dict[str, Any]]) -> Judgement:
    """`mine`: the actions taken for the fault; `later`: every action of its job (those
    taken after `mine` are looked at)."""
    verdict = Judgement(
        checkpoints_not_committed=[
            str(a["error"]) for a in mine if a["type"] == CHECKPOINT and a["status"] == "failed"
        ]
    )
    mine = sorted(mine, key=lambda a: int(a["id"]))
    remedies = [a for a in mine if a["type"] != CHECKPOINT]
    if any(a["status"] not in FINISHED for a in mine):
        verdict.healed, verdict.why_not = False, "an action still open"
    elif remedies and remedies[-1]["status"] == "failed":
        last = remedies[-1]
        healer = _later_success(last, later)
        if healer is None:
            verdict.healed = False
            verdict.why_not = "; ".join(
                f"{a['type']}: {a['error']}" for a in remedies if a["status"] == "failed"
            )
        else:
            verdict.healed_by = f"{healer['type']} #{healer['id']}"
    return verdict


def _later_success(failed: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any] | None:
    ended = timestamp(failed.get("finished_at") or failed.get("created_at"))
    for a in sorted(actions, key=lambda a: int(a["id"])):
        if int(a["id"]) <= int(failed["id"]) or a["type"] == CHECKPOINT:
            continue
        if a.get("job") != failed.get("job") or a["status"] != "succeeded":
            continue
        started = timestamp(a.get("created_at"))
        if ended is None or started is None or (started - ended).total_seconds() <= LATER_REMEDY_S:
            return a
    return None


def timestamp(stamp: Any) -> datetime | None:
    """A record's ISO time, in UTC (the records are), or None where there is none."""
    if not isinstance(stamp, str):
        return None
    when = datetime.fromisoformat(stamp)
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)  # records are UTC
