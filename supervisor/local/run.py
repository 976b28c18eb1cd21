"""`supervisor run`: your own job on a local cluster, watched and healed by the supervisor,
started and ended as torchrun starts and ends it.

The cluster is the demo's (supervisor/local/demo.py: a host monitor per node, spares, the
supervisor with the local backend); the job is your command. While it runs, the workers'
output comes to the terminal behind their ranks (tee.py) and each action of the
supervisor gets a line. It ends when every rank of the job's current attempt ended with
exit code 0 (exit code 0), when the supervisor gave up on it (the exit code of its first
failed rank, else 1), or when a node of the job was lost and the supervisor could not move
the job off it (1); either way every process it started is stopped.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx

from supervisor.local.cluster_state import ClusterState, JobSpec
from supervisor.local.demo import LocalDemo
from supervisor.local.tee import RankTee

POLL_S = 0.25
#: How long a job's end waits for the supervisor's actions in flight to end.
ACTIONS_END_S = 10.0
#: What `supervisor run` exits with when the supervisor gave up and no rank has an exit
#: code to give (a node lost, a hang): torchrun's for a failed job.
FAILED = 1
#: 128 + a signal: how a shell reports a process the signal ended.
SIGNALLED = 128
#: An action's final states.
FINISHED = ("succeeded", "failed")


@dataclass(frozen=True)
class Outcome:
    code: int
    why: str


#: How a restart or a swap went, said in its line: in-process (the other ranks kept their
#: processes) or with every rank started again.
HEALED = {"in_process": " in-process", "full_restart": " by restarting every rank"}


class JobRun:
    """Watches the job of a started `LocalDemo` until it ends."""

    def __init__(
        self,
        demo: LocalDemo,
        out: TextIO = sys.stdout,
        shown_ranks: frozenset[int] | None = None,
    ) -> None:
        """`shown_ranks`: the ranks whose output comes to `out` (None: every rank)."""
        self.demo = demo
        self.out = out
        self.tee = RankTee(demo.run_dir / "nodes", demo.options.job, out, shown_ranks)
        self._told: set[int] = set()
        self._noted: set[tuple[str, str]] = set()  # (type, job) of the notes said once
        self._lost: dict[str, datetime] = {}  # node -> when its host monitor was seen gone

    def wait(self, stopping: Callable[[], bool]) -> Outcome | None:
        """Until the job ends (its outcome) or `stopping()` says so (None)."""
        try:
            while not stopping():
                self._keep_supervisor()
                self.tee.pump()
                actions = self._actions()
                self._tell_actions(actions)
                outcome = self.outcome(actions)
                if outcome is not None:
                    self._actions_end()
                    return outcome
                time.sleep(POLL_S)
            return None
        finally:
            self.tee.pump(final=True)

    def outcome(self, actions: list[dict[str, Any]]) -> Outcome | None:
        """The job's end, or None while it is at work (or being healed). `actions`: the
        supervisor's newest, newest first."""
        view = self._api(f"/api/v1/jobs/{self.demo.options.job}")
        job = ClusterState.load(self.demo.run_dir).job
        if job is None:
            return None
        stranded = self._stranded(job, actions)
        if stranded is not None:
            return stranded
        workers = self._workers(job)
        if view is not None and view.get("state") == "given_up":
            failed = [code for _, (_, code) in sorted(workers.items()) if code]
            # A rank killed by a signal (a negative code): 128 + the signal, as a shell says.
            code = (failed[0] if failed[0] > 0 else SIGNALLED - failed[0]) if failed else FAILED
            return Outcome(code, f"the supervisor gave up on the job: {view['given_up_reason']}")
        # Exited 0, or stopped with 0 (a worker that said it finished: the worker client's
        # `finished()`); not while an action may be stopping them for a restart.
        ended = len(workers) == job.world_size and all(
            state in ("exited", "stopped") and code == 0 for state, code in workers.values()
        )
        if ended and self._quiet(actions):
            return Outcome(0, f"every rank of the job ({job.world_size}) ended with exit code 0")
        return None

    def _quiet(self, before: list[dict[str, Any]]) -> bool:
        """No action of the supervisor was in flight before the workers were read
        (`before`) nor after, and none began meanwhile: what they said is not a stop for
        a restart."""
        after = self._actions()
        in_flight = any(a["status"] not in FINISHED for a in [*before, *after])
        return not in_flight and [a["id"] for a in after[:1]] == [a["id"] for a in before[:1]]

    def _stranded(self, job: JobSpec, actions: list[dict[str, Any]]) -> Outcome | None:
        """A node of the job is gone, the supervisor's remedy since it noticed (its
        `host_heartbeat_lost`) failed, and no other is in flight: nothing more will move
        the job (no spare left to take the node's place, and scaling off). A remedy
        decided before it noticed (a restart of the survivors whose collective broke)
        may fail on the lost node: the remedy for the loss comes after it."""
        now = datetime.now(UTC)
        for node, monitor in self.demo.monitors.items():
            if monitor.poll() is None:
                self._lost.pop(node, None)
            else:
                self._lost.setdefault(node, now)
        lost = [node for node in job.placement if node in self._lost]
        if not lost or any(a["status"] not in FINISHED for a in actions):
            return None
        noticed = [self._noticed(node) for node in lost]
        if any(at is None for at in noticed):
            return None  # the supervisor has not declared it lost yet: its remedy follows
        since = min(at for at in noticed if at is not None)
        failed = [
            a
            for a in actions
            if a["job"] == job.name
            and a["status"] == "failed"
            and a["type"] != "emergency_checkpoint"  # nothing saved does not stop a remedy
            and datetime.fromisoformat(a["created_at"]) >= since
        ]
        if not failed:
            return None
        return Outcome(
            FAILED,
            f"{', '.join(lost)} lost, and the supervisor could not move the job off it "
            f"({failed[0]['type']} failed: {failed[0]['error']}): a spare (--spares) "
            "takes a lost node's place",
        )

    def _noticed(self, node: str) -> datetime | None:
        """When the supervisor declared `node` lost (its newest `host_heartbeat_lost`)."""
        listed = self._api("/api/v1/events", type="host_heartbeat_lost", node=node, limit=1)
        items = listed["items"] if listed else []
        return datetime.fromisoformat(items[0]["time"]) if items else None

    def _workers(self, job: JobSpec) -> dict[int, tuple[str, int | None]]:
        """(state, exit code) of each rank the job's nodes report; a node that does not
        answer reports none."""
        found: dict[int, tuple[str, int | None]] = {}
        auth = {"Authorization": f"Bearer {self.demo.actuator_token}"}
        for node in job.placement:
            port = self.demo.node_ports.get(node)
            try:
                status = self.demo.http.get(
                    f"http://127.0.0.1:{port}/v1/status", headers=auth, timeout=2
                ).json()
            except (httpx.HTTPError, ValueError):
                continue
            for worker in status.get("workers", []):
                found[worker["rank"]] = (worker["state"], worker["exit_code"])
        return found

    def _keep_supervisor(self) -> None:
        """Start the supervisor again when it exited, as its Deployment would: it takes
        the job over from its database while the job trains on."""
        supervisor = self.demo.supervisor
        if supervisor is None or (exited := supervisor.poll()) is None:
            return
        self.out.write(f"{_clock(None)} [supervisor]: exited ({exited}); starting it again\n")
        self.demo.restart_supervisor()

    def _actions_end(self) -> None:
        """The job ended: until the supervisor's actions in flight end too (a restart
        whose workers were done before it was), for a while at most, telling each."""
        deadline = time.monotonic() + ACTIONS_END_S
        while self._tell_actions(self._actions()) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _actions(self) -> list[dict[str, Any]]:
        """The supervisor's newest actions, newest first (none while it does not answer)."""
        listed = self._api("/api/v1/actions", limit=20)
        return list(listed["items"]) if listed else []

    def _tell_actions(self, actions: list[dict[str, Any]]) -> bool:
        """A line for each action of the supervisor once it ended, oldest first; True
        while one has not."""
        in_flight = False
        for action in reversed(actions):
            if action["status"] not in FINISHED:
                in_flight = True
            if action["id"] in self._told or in_flight:
                continue
            self._told.add(action["id"])
            note = (action.get("result") or {}).get("note")
            if note is not None:
                # Information, not an outcome (a job that takes no emergency
                # checkpoints): said once, not at every fault.
                if (action["type"], action["job"]) not in self._noted:
                    self._noted.add((action["type"], action["job"]))
                    self.out.write(
                        f"{_clock(action.get('finished_at'))} [supervisor]: "
                        f"{action['type']}: {note}\n"
                    )
                continue
            where = f" {action['node']}" if action["node"] else ""
            why = action["reason"] if action["status"] == "succeeded" else action["error"]
            how = HEALED.get(str((action.get("result") or {}).get("path")), "")
            self.out.write(
                f"{_clock(action.get('finished_at'))} [supervisor]: "
                f"{action['type']}{where} {action['status']}{how}: {why}\n"
            )
        return in_flight

    def _api(self, path: str, **params: Any) -> Any:
        try:
            return self.demo.api(path, **params)
        except (httpx.HTTPError, ValueError):
            return None  # not up yet, restarting, or the job not seen yet


def _clock(at: str | None) -> str:
    """The local time of day of `at` (the API's ISO 8601 time; None: now), to the second:
    the supervisor's lines say when, among the ranks' own."""
    moment = datetime.fromisoformat(at) if at else datetime.now(UTC)
    return moment.astimezone().strftime("%H:%M:%S")
