"""The chaos run's account of the supervisor's own faults (bench/chaos.py): a fault is
judged by its last remedy; an emergency checkpoint that did not commit is listed apart,
with its error, and fails no remedy that went on to heal the job."""

from __future__ import annotations

from typing import Any

from bench import chaos
from bench.chaos_judge import LATER_REMEDY_S
from bench.chaos_report import _rows

SCHEDULE = 7


class Supervisor:
    """What the account reads of the supervisor's REST API (`LocalDemo.api`)."""

    def __init__(self, faults: list[dict[str, Any]], actions: list[dict[str, Any]]) -> None:
        self.faults = {f["id"]: f for f in faults}
        self.actions = actions

    def api(self, path: str, **params: Any) -> Any:
        if path == "/api/v1/faults":
            return list(self.faults.values())
        if path.startswith("/api/v1/faults/"):
            return self.faults[int(path.rsplit("/", 1)[1])]
        assert path == "/api/v1/actions", path
        return {"items": self.actions, "next_cursor": None}


def fault(id_: int, kind: str, node: str, actions: list[int]) -> dict[str, Any]:
    return {
        "id": id_,
        "kind": kind,
        "node": node,
        "params": {"schedule": SCHEDULE},
        "events": [100 + id_],
        "actions": actions,
        "created_at": "2026-01-01T00:00:00+00:00",
        "ended_at": None,
    }


def action(id_: int, type_: str, status: str, error: str | None = None) -> dict[str, Any]:
    return {"id": id_, "type": type_, "status": status, "error": error}


def test_a_fault_is_judged_by_its_last_remedy_and_a_checkpoint_that_did_not_commit_is_listed() -> (
    None
):
    nothing = "no worker of the job is registered with its host monitor: nothing to save"
    supervisor = Supervisor(
        [
            # Between worlds: nothing to save, then the swap healed it.
            fault(1, "node_down", "node-1", [2, 1]),
            # The swap failed, and a retry of the remedy (a full restart) healed it.
            fault(2, "worker_crash", "node-0", [3, 4, 5]),
            # The remedy failed and nothing healed it after.
            fault(3, "worker_hang", "node-0", [6, 7]),
            # Still at work.
            fault(4, "xid", "node-2", [8]),
        ],
        [
            action(1, "emergency_checkpoint", "failed", nothing),
            action(2, "hot_swap", "succeeded"),
            action(3, "emergency_checkpoint", "succeeded"),
            action(4, "hot_swap", "failed", "no reachable spare node"),
            action(5, "restart_workload", "succeeded"),
            action(6, "emergency_checkpoint", "succeeded"),
            action(7, "restart_in_place", "failed", "could not start workers"),
            action(8, "emergency_checkpoint", "running"),
        ],
    )
    result = chaos.ChaosResult()
    chaos._account(supervisor, SCHEDULE, result)  # type: ignore[arg-type]
    assert (result.injected, result.remediated) == (4, 2)
    assert result.not_remediated == [
        "worker_hang on node-0: restart_in_place: could not start workers",
        "xid on node-2: an action still open",
    ]
    assert result.checkpoints_not_committed == [f"node_down on node-1: {nothing}"]
    assert result.stuck_actions == 1
    rows = {row.measurement.strip(): row for row in _rows(chaos.ChaosConfig(), result)}
    listed = rows["emergency checkpoints that did not commit (reported; the remedy went on)"]
    assert listed.result == "1"
    assert f"node_down on node-1: {nothing}" in rows


def test_a_fault_whose_remedy_failed_is_healed_by_the_jobs_next_remedy_soon_after() -> None:
    """Two faults landing together: the first's swap found its spare downed a moment
    later and failed; the second's swap, 20 s on, healed the job. The first counts as
    healed, by that swap, and says so. A later success past LATER_REMEDY_S, or another
    job's, heals nothing."""

    def timed(id_: int, type_: str, status: str, at_s: float, job: str = "chaos") -> dict[str, Any]:
        stamp = f"2026-01-01T00:{int(at_s) // 60:02d}:{int(at_s) % 60:02d}+00:00"
        record = action(id_, type_, status, None if status == "succeeded" else "no spare")
        return {**record, "job": job, "created_at": stamp, "finished_at": stamp}

    late = int(LATER_REMEDY_S) + 30
    supervisor = Supervisor(
        [
            fault(1, "worker_crash", "node-0", [1]),
            fault(2, "node_down", "node-2", [2]),
            fault(3, "worker_hang", "node-1", [3]),
        ],
        [
            timed(1, "hot_swap", "failed", 10),
            timed(2, "hot_swap", "succeeded", 30),
            timed(3, "restart_in_place", "failed", 200),
            timed(4, "restart_workload", "succeeded", 210, job="other"),
            timed(5, "restart_workload", "succeeded", 200 + late),
        ],
    )
    result = chaos.ChaosResult()
    chaos._account(supervisor, SCHEDULE, result)  # type: ignore[arg-type]
    assert (result.injected, result.remediated) == (3, 2)
    assert result.healed_later == ["worker_crash on node-0: by hot_swap #2"]
    assert result.not_remediated == ["worker_hang on node-1: restart_in_place: no spare"]
    rows = [row.measurement.strip() for row in _rows(chaos.ChaosConfig(), result)]
    assert (
        "its own remedy failed, healed by a later one: worker_crash on node-0: by hot_swap #2"
        in rows
    )
