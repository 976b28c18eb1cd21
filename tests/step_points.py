"""Faults that land at a chosen point of a training step of a user's script: the script,
edited as a test saves it, holds each rank at `pause(step, point)` until the test releases
it; the test injects the fault through the supervisor's API while every rank is held there
and releases them once the emergency request reached the ranks that save (before the
optimizer's step: once the remedy is done).

Points: "before" the optimizer's step (the rank's state is still the previous step's),
"inside" it (a step pre-hook registered after the Checkpointer's own: the step has begun,
no parameter changed yet) and "after" it (the scheduler and the user's object stepped,
`step_done` not called). Held inside or after, an emergency save waits for the step's
`step_done` and holds that step.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from subprocess import Popen
from typing import Any, NamedTuple, Protocol

from tests.timing import scaled

#: Each rank writes a marker (its process id) and waits for the test's release, once per
#: rank and point: a step run again after a resume does not stop there again.
PAUSE_FUNCTION = """
def pause(step: int, point: str) -> None:
    if f"{step}:{point}" not in os.environ.get("PAUSES", "").split(","):
        return
    folder = pathlib.Path(os.environ["PAUSE_DIR"])
    marker = folder / f"at-{step}-{point}-rank{rank}"
    released = folder / f"release-{step}-{point}"
    if marker.exists() or released.exists():
        return
    marker.write_text(str(os.getpid()))
    deadline = time.monotonic() + 600
    while not released.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


"""
PAUSE = "\ncurrent_step = [0]\n\n" + PAUSE_FUNCTION + "class DataPosition:"

#: The edits that put the points into an example of docs/training.md (with a sleep of
#: STEP_TIME_S per step after the optimizer's, so that the run lasts).
EDITS = {
    "import os\n": "import hashlib\nimport os\nimport pathlib\nimport time\n",
    "class DataPosition:": PAUSE.lstrip("\n"),
    "    generator = torch.Generator()": "    current_step[0] = step\n"
    "    generator = torch.Generator()",
    "    optimizer.step()\n": '    pause(step, "before")\n    optimizer.step()\n',
    "    data.batches += 1\n": "    data.batches += 1\n"
    '    time.sleep(float(os.environ["STEP_TIME_S"]))\n'
    '    pause(step, "after")\n',
    "start = ckpt.restore()": "optimizer.register_step_pre_hook("
    'lambda *_: pause(current_step[0], "inside"))\nstart = ckpt.restore()',
}


class FaultAt(NamedTuple):
    step: int
    point: str  # "before", "inside" or "after"
    kind: str  # "node_down" or "worker_crash"
    rank: int  # the rank that crashes, or one of the node that goes down
    saving: tuple[int, ...]  # the ranks the emergency checkpoint asks (the other nodes')
    saved: int  # the step it holds

    def remedy(self) -> str:
        return "hot_swap" if self.kind == "node_down" else "restart_in_place"


class UserRun(Protocol):
    run_dir: Path
    proc: Popen[str]
    lines: list[str]

    def api(self, method: str, path: str, **body: Any) -> Any: ...


def env_of(pauses: Path, faults: Sequence[FaultAt]) -> dict[str, str]:
    return {"PAUSES": ",".join(f"{f.step}:{f.point}" for f in faults), "PAUSE_DIR": str(pauses)}


def node_of(run: UserRun, rank: int) -> str:
    """The live node that runs `rank` now (a hot swap moves ranks to a spare)."""
    for node in run.api("GET", "/api/v1/nodes"):
        ranks = {w["rank"] for w in node["workers"] if w["state"] == "running"}
        if rank in ranks and node["state"] == "running":
            return str(node["name"])
    raise AssertionError(f"no node runs rank {rank}: {run.api('GET', '/api/v1/nodes')}")


def inject_at_points(
    run: UserRun, pauses: Path, faults: Sequence[FaultAt], ranks: int
) -> list[str]:
    """Each fault in turn, injected while all `ranks` are held at its point; returns the
    line the supervisor says for each remedy."""
    said = []
    for f in faults:

        def held(step: int, point: str) -> bool:
            return all((pauses / f"at-{step}-{point}-rank{r}").exists() for r in range(ranks))

        wait_until(partial(held, f.step, f.point), 240, f"every rank at {f}", run)
        node = node_of(run, f.rank)
        fault: dict[str, Any] = {"kind": f.kind, "node": node}
        if f.kind == "worker_crash":
            fault["rank"] = f.rank
        injected = time.time() - 1  # the files' clock is coarser than time.time()
        run.api("POST", "/api/v1/faults", **fault)
        delivered = partial(requests_delivered, run.run_dir, f.saving, injected)
        wait_until(delivered, 120, f"the emergency request handed to ranks {f.saving}", run)
        said.append(f"[supervisor]: {f.remedy()} {node} succeeded")
        release = pauses / f"release-{f.step}-{f.point}"
        # Inside or after the optimizer's step, the save waits for the step's end: released
        # once the ranks' client threads took the request. Before it, held until the
        # remedy is done: their save holds the step before, at once; released sooner, the
        # survivors could take the optimizer's step before the remedy stopped them, and
        # their collective raising then saved that step on their way out, one past the one
        # asked (seen on a loaded machine).
        if f.point != "before":
            time.sleep(0.5)
            release.touch()
        # The next fault targets a node by the ranks it runs once the remedy is done.
        wait_until(partial(_said, run, said[-1]), 240, said[-1], run)
        if f.point == "before":
            release.touch()
    return said


def _said(run: UserRun, line: str) -> bool:
    return any(line in said for said in list(run.lines))


def assert_saved_and_resumed(
    output: str, faults: Sequence[FaultAt], ranks: int, resumed: Sequence[int]
) -> None:
    """Each emergency checkpoint saved by the ranks it asked, of the step they held, and
    every rank started from nothing and then from each of `resumed`. (A rank of the
    failed node whose collective raised saves on its way out too, unasked: the same step,
    never another.)"""
    for rank in range(ranks):
        saved = re.findall(
            rf"\[rank{rank}\]: checkpoint: emergency checkpoint of step (\d+) saved", output
        )
        asked = {f.saved for f in faults if rank in f.saving}
        assert asked <= {int(step) for step in saved} <= {f.saved for f in faults}, (rank, output)
        starts = re.findall(rf"\[rank{rank}\]: rank {rank}: starting after step (\d+)", output)
        assert starts == ["0", *map(str, resumed)], (rank, output)


def requests_delivered(run_dir: Path, ranks: tuple[int, ...], since: float) -> bool:
    """Whether each of `ranks` was handed an emergency request after `since` (its host
    monitor writes the request's id to the rank's file, then signals it)."""
    return all(_handed(run_dir, rank, since) for rank in ranks)


def _handed(run_dir: Path, rank: int, since: float) -> bool:
    # The nodes' folders only: a walk of the whole run folder meets the peer stores'
    # incoming copies, which vanish as they are committed (it failed so once).
    for path in run_dir.glob(f"nodes/*/*.rank{rank}.emergency-request"):
        try:  # a start of the rank removes its file: it may vanish as it is read
            if path.stat().st_mtime >= since and path.read_text().strip():
                return True
        except FileNotFoundError:
            continue
    return False


def wait_until(condition: Callable[[], bool], within: float, what: str, run: UserRun) -> None:
    deadline = time.monotonic() + scaled(within)
    while time.monotonic() < deadline:
        if condition():
            return
        if run.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"not seen: {what}\n" + "\n".join(run.lines[-80:]))
