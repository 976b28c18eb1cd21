"""Cost of a job's goodput from its stored history (`GET /api/v1/jobs/{job}/goodput`).

`python -m bench.goodput [--hours 24] [--ranks 4 32]`: a synthetic job of one step per
second, a local checkpoint every 10 steps (0.2 s) and a durable one every 100 (1 s) from
every rank, a step sample every 10 s and one failure per 6 hours (emergency checkpoint,
hot swap, load), stored through the repository in a temporary SQLite database; then the
read (`Store.job_history`), the timeline, the goodput alone and with a 20-point series
(what the endpoint computes) are timed, best of 3. The read summarises the ranks'
reports of one checkpoint in SQL, so it should not grow with the ranks. Target: the
whole answer for a day of history in under 2 s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from resiliency_protocol.checkpoint_reports import Tier
from supervisor.domain import (
    ActionRequest,
    ActionType,
    CheckpointReport,
    Event,
    EventType,
    ProgressSample,
)
from supervisor.goodput.breakdown import compute_goodput
from supervisor.goodput.history import timeline_from_history
from supervisor.store import Store, open_store

T0 = datetime(2026, 1, 1, tzinfo=UTC)
JOB = "bench"


def populate(store: Store, hours: float, ranks: int) -> int:
    seconds = int(hours * 3600)
    reports: list[CheckpointReport] = []
    samples: list[ProgressSample] = []
    n = 0
    for step in range(1, seconds + 1):
        t = T0 + timedelta(seconds=step)
        for every, tier, cost in ((10, "local", 0.2), (100, Tier.DURABLE, 1.0)):
            if step % every == 0:
                for r in range(ranks):
                    n += 1
                    done = t + timedelta(seconds=cost)
                    reports.append(
                        CheckpointReport(f"r{n}", f"n{r}", JOB, r, "saved", step, cost, tier, done)
                    )
        if step % 10 == 0:
            samples.append(ProgressSample(JOB, step, t))
        if len(reports) >= 1000:
            store.record_checkpoint_reports(reports)
            reports = []
    store.record_checkpoint_reports(reports)
    store.record_progress_samples(samples)
    events = [
        Event(EventType.HOST_HEARTBEAT_LOST, T0 + timedelta(hours=h + 0.5), node="n0", job=JOB)
        for h in range(0, int(hours), 6)
    ]
    store.record(events)
    for i, _ in enumerate(events):
        store.create_action(
            ActionRequest(ActionType.HOT_SWAP, job=JOB, node="n0"), key=f"h{i}", source="bench"
        )
    return n


def measure(store: Store, hours: float) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(3):
        t0 = time.perf_counter()
        history = store.job_history(JOB)
        t1 = time.perf_counter()
        timeline, _ = timeline_from_history(
            JOB,
            created_at=T0,
            events=history.events,
            actions=history.actions,
            checkpoints=history.checkpoints,
            samples=history.samples,
            now=T0 + timedelta(hours=hours),
        )
        t2 = time.perf_counter()
        compute_goodput(timeline)
        t3 = time.perf_counter()
        compute_goodput(timeline, series_points=20)  # what the endpoint runs
        t4 = time.perf_counter()
        run = {"read": t1 - t0, "timeline": t2 - t1, "goodput": t3 - t2, "series": t4 - t3}
        run["total"] = run["read"] + run["timeline"] + run["series"]
        if not best or run["total"] < best["total"]:
            best = run
    return best


def run(hours: float, ranks: int) -> tuple[int, dict[str, float]]:
    """(reports stored, best timings) for one synthetic job in a fresh SQLite database."""
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(f"sqlite:///{Path(tmp) / 'bench.db'}")
        try:
            n = populate(store, hours, ranks)
            return n, measure(store, hours)
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 32])
    args = parser.parse_args()
    print(
        "| ranks | reports | read | timeline | goodput | goodput + 20-point series "
        f"| read + timeline + goodput with series ({args.hours:g} h) |"
    )
    print("|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        n, m = run(args.hours, ranks)
        verdict = "ok" if m["total"] < 2.0 or args.hours > 24 else "over 2 s"
        print(
            f"| {ranks} | {n:,} | {m['read']:.2f} s | {m['timeline']:.2f} s | "
            f"{m['goodput']:.2f} s | {m['series']:.2f} s | {m['total']:.2f} s ({verdict}) |"
        )


if __name__ == "__main__":
    main()
