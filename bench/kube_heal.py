"""kube-heal: how long an in-process heal of a PyTorch JobSet takes on a real Kubernetes
control plane, crash after crash of the same pod.

The tests' control plane (tests/control_plane.py: etcd, kube-apiserver, the controller
manager with the real Job controller, the scheduler, the real JobSet controller) and the
chart's example PyTorch JobSet healing in-process (tests/kube_real_in_process.py: two
pods of one DDP rank each on gloo, a real host monitor per node, the supervisor as the
chart's ServiceAccount). The worker of rank 1's pod is SIGKILLed `crashes` times, each
once the job trains again; a heal is timed from the kill to its `restart_in_place`
recorded as succeeded (every rank trains in the new world).

Both ways of replacing the crashed pod, in the same run: the supervisor recreating its
Job (`kube_recreate_replaced_jobs`, the default), and the baseline, the Job replacing the
pod itself, which the Job controller does only after its pod-failure backoff: 10 s,
doubled at each failure of the Job, reset only by a pod that succeeds.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.table import Row, verdict

CRASHES = 3
#: A heal's time may vary this much between crashes and still count as flat.
FLAT_WITHIN = 1.5


@dataclass(frozen=True)
class HealTimes:
    recreate: bool
    seconds: list[float]


def _tests(module: str) -> Any:
    """A module of the tests' real-plane harness, imported when the bench runs (and not
    followed by the type checker: the tests are typed apart)."""
    return importlib.import_module(f"tests.{module}")


def _env_class() -> Any:
    """The test environment, with the setting under test and a job that trains until
    stopped."""

    class LongRun(_tests("kube_real_in_process").RealInProcess):  # type: ignore[misc]
        recreate = True

        def supervisor_env(self) -> dict[str, str]:
            flag = "true" if self.recreate else "false"
            return {**super().supervisor_env(), "SUPERVISOR_KUBE_RECREATE_REPLACED_JOBS": flag}

        def jobset(self) -> dict[str, Any]:
            body: dict[str, Any] = super().jobset()
            pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            for var in pod["containers"][0]["env"]:
                if var["name"] == "TOTAL_STEPS":
                    var["value"] = "1000000"
            return body

    return LongRun


def _succeeded(env: Any) -> list[dict[str, Any]]:
    return [a for a in env.actions("restart_in_place") if a["status"] == "succeeded"]


def heal_times(plane: Any, who: Any, work: Path, *, recreate: bool, crashes: int) -> HealTimes:
    fixtures = _tests("kube_real_fixtures")
    started, wait_for = fixtures.started, fixtures.wait_for
    training = _tests("kube_real_in_process").training
    work.mkdir(parents=True)
    env = _env_class()(plane, who, work, "kh" + ("r" if recreate else "b"), count=2)
    env.recreate = recreate
    seconds: list[float] = []
    with started(env):
        training(env, past=20)
        for _ in range(crashes):
            node = env.ranks()[1]["spec"]["nodeName"]
            before = len(_succeeded(env))
            killed = time.time()
            env.crash_worker(node)
            done = wait_for(
                lambda: (a := _succeeded(env)) and len(a) > before and a[-1],  # noqa: B023
                300,
                "the heal",
            )
            finished = datetime.fromisoformat(done["finished_at"]).timestamp()
            seconds.append(finished - killed)
            past = env.step() + 10
            wait_for(lambda: env.step() >= past, 120, f"step {past}")  # noqa: B023
    return HealTimes(recreate, seconds)


def measure(crashes: int = CRASHES, keep: Path | None = None) -> tuple[HealTimes, HealTimes]:
    chart_identity = _tests("chart_rbac").chart_identity
    ControlPlane = _tests("control_plane").ControlPlane
    work = Path(tempfile.mkdtemp(prefix="kube-heal-", dir=keep))
    plane = ControlPlane(work / "plane")
    try:
        plane.start(within=300)
        who = chart_identity(plane, "default")
        recreated = heal_times(plane, who, work / "recreated", recreate=True, crashes=crashes)
        baseline = heal_times(plane, who, work / "baseline", recreate=False, crashes=crashes)
    except BaseException:
        print(f"kube-heal: the run's logs are in {work}", file=sys.stderr)
        raise
    finally:
        plane.stop()
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return recreated, baseline


def verdicts(recreated: HealTimes, baseline: HealTimes) -> tuple[bool, bool]:
    """(the heals with the Job recreated stay flat crash after crash, the last of them is
    faster than the baseline's last)."""
    flat = max(recreated.seconds) <= FLAT_WITHIN * min(recreated.seconds)
    faster = recreated.seconds[-1] < baseline.seconds[-1]
    return flat, faster


def rows(crashes: int = CRASHES) -> list[Row]:
    recreated, baseline = measure(crashes)
    flat, faster = verdicts(recreated, baseline)

    def times(h: HealTimes) -> str:
        return ", ".join(f"{s:.1f} s" for s in h.seconds)

    ratio = baseline.seconds[-1] / recreated.seconds[-1]
    return [
        Row(
            f"kube-heal: {crashes} crashes of one pod in a row, each healed in-process, its"
            " Job recreated (default)",
            times(recreated),
            f"{times(baseline)} (the Job replacing the pod; last {ratio:.1f}x)",
            f"flat within {FLAT_WITHIN}x; last faster than the baseline's",
            verdict(flat and faster),
        )
    ]
