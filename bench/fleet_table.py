"""The fleet-shaped ingest rows of the bench's table (bench/fleet.py measures)."""

from __future__ import annotations

from pathlib import Path

from bench import fleet
from bench.fleet import FleetWindow, Group, Phase
from bench.table import Row, verdict

CPU_TARGET_US = 50.0
#: "Flat": the larger fleet's figure at most this much above the smaller's (the machine's
#: noise between two windows a minute apart is about as large).
FLAT = 1.25
#: Statements per second may also differ by this many (one timer's turn more or less).
SQL_SLACK = 0.5
#: The largest fleet (25,000 nodes of 8 GPUs heartbeating every 5 s) and the headroom one
#: supervisor process must have over it.
FLEET_NODES, FLEET_PERIOD_S, COVERAGE = 25_000, 5.0, 1.5
#: The batch sizes of the relayed rows (`POST /api/v1/heartbeats/batch`).
BATCHES = (16, 64)


def groups(quick: bool) -> list[Group]:
    """The fleets measured: jobs of 8,000 ranks (8 workers a node) and of 1,000 (1 a
    node), on SQLite and PostgreSQL, at 2,000 nodes every 5 s one request a beat and
    through a relay, and at 25,000 every 5 s (the fleet's rate) through a relay; beats
    late by up to half the heartbeat timeout (3 periods, as by default); with every beat
    on time, and every 15 s, besides."""
    late = 7.5  # half the default heartbeat timeout (15 s)
    if quick:
        # 25,000 nodes every 25 s: 1,000 beats a second, which a shared 2-core machine
        # sustains beside the client (the CPU per heartbeat is what the row compares).
        # Each fleet one request a beat, then through a relay in batches of 16 and 64.
        phases = tuple(
            Phase(nodes, late, period_s=period, batch=batch)
            for nodes, period in ((2000, 5.0), (25_000, 25.0))
            for batch in (1, *BATCHES)
        )
        return [Group("sqlite", 8, 8000, phases)]
    # 25,000 nodes every 5 s is 5,000 beats a second: more than one client here sends as
    # a request each (to both servers). At that rate the beats go as production's relays
    # send them, in batches, and the bare app is sent the same batches (its CPU per
    # heartbeat: the stack's for the same requests); so are 2,000 nodes' batches, to
    # compare like with like.
    relayed = tuple(
        Phase(nodes, late, batch=b, bare_batched=True) for nodes in (2000, 25_000) for b in BATCHES
    )
    single = (Phase(2000, 0), Phase(2000, late))
    return [
        Group("sqlite", 8, 8000, (*single, *relayed)),
        Group("postgresql", 8, 8000, (single[1], *relayed)),
        Group("sqlite", 1, 1000, (single[1], *relayed[len(BATCHES) :])),
        Group("postgresql", 1, 1000, (single[1], *relayed[len(BATCHES) :])),
        # The slow end of fleets' periods (1,667 beats a second); the timeout three
        # periods, as by default.
        Group(
            "sqlite", 8, 8000, (Phase(25_000, 22.5, period_s=15.0, batch=64, bare_batched=True),)
        ),
    ]


def fleet_rows(quick: bool, duration_s: float, profile_dir: Path | None = None) -> list[Row]:
    rows: list[Row] = []
    for group in groups(quick):
        if group.database == "postgresql" and _no_postgres():
            rows.append(Row(_group_name(group), "not run: " + _no_postgres(), verdict="info"))
            continue
        windows = fleet.run_group(group, duration_s, profile_dir=profile_dir)
        rows += [_row(w) for w in windows]
        rows += _group_rows(windows)
    return rows


def _no_postgres() -> str:
    from tests.postgres import MISSING, binaries

    return "" if binaries() is not None else MISSING


def _group_name(group: Group) -> str:
    return (
        f"Fleet ingest, {group.database}: nodes of {group.workers} worker"
        f"{'s' if group.workers > 1 else ''}, jobs of {group.ranks_per_job:,} ranks"
    )


def _row(w: FleetWindow) -> Row:
    g, p = w.group, w.phase
    ok = w.cpu_us <= CPU_TARGET_US and w.errors == 0
    return Row(
        f"{_group_name(g)}, {p.nodes:,} nodes every {p.period_s:g}s, late by 0-{p.jitter_s:g}s"
        + _batched(w),
        f"{w.cpu_us:.0f} us CPU/heartbeat ({w.rate:,.0f}/s), {w.sql_per_s:.2f} SQL stmt/s"
        + _pruner(w)
        + f", p99 {w.p99_ms:.1f} ms"
        + (f", {w.errors} ERRORS" if w.errors else ""),
        f"bare ASGI app{' (same batches)' if p.bare_batched else ''}: {w.bare_cpu_us:.0f} us"
        f" (supervisor {w.cpu_us / w.bare_cpu_us:.2f}x,"
        f" +{w.cpu_us - w.bare_cpu_us:.0f} us); client {w.client_cpu_pct:.0f}% CPU,"
        f" sent late p99 {w.late_p99_ms:.0f} ms",
        f"<= {CPU_TARGET_US:.0f} us",
        verdict(ok),
    )


def _pruner(w: FleetWindow) -> str:
    """The history pruner's statements in the window (its pass's, and the scheduler's as
    it wakes to run it), counted apart from the rate: its first pass comes a minute after
    the supervisor's start, then hourly (no steady rate)."""
    if not w.pruner_statements:
        return ""
    return f" (and {w.pruner_statements} of the history pruner's pass, apart)"


def _batched(w: FleetWindow) -> str:
    """The row's batches, as sent (a batch is cut short after the relay's hold)."""
    if w.phase.batch == 1:
        return ""
    mean = w.heartbeats / w.requests if w.requests else 0.0
    return f", through a relay in batches of {w.phase.batch} (mean {mean:.1f})"


def _group_rows(windows: list[FleetWindow]) -> list[Row]:
    rows = []
    by_shape: dict[tuple[float, int], list[FleetWindow]] = {}
    for w in windows:
        by_shape.setdefault((w.phase.jitter_s, w.phase.batch), []).append(w)
    for (jitter, batch), same in by_shape.items():
        small, large = min(same, key=_nodes), max(same, key=_nodes)
        if small is large:
            continue
        growth = large.cpu_us / small.cpu_us
        bare_growth = large.bare_cpu_us / small.bare_cpu_us
        batches = f", batches of {batch}" if batch > 1 else ""
        rows.append(
            Row(
                f"  CPU/heartbeat {small.phase.nodes:,} -> {large.phase.nodes:,} nodes"
                f" (late by 0-{jitter:g}s{batches})",
                f"{small.cpu_us:.0f} -> {large.cpu_us:.0f} us ({growth:.2f}x)",
                f"bare ASGI app {bare_growth:.2f}x",
                f"flat (<= {FLAT:g}x)",
                verdict(growth <= FLAT),
            )
        )
    first = windows[0]
    worst = max(windows, key=lambda w: w.sql_per_s)
    flat_sql = worst.sql_per_s <= FLAT * first.sql_per_s + SQL_SLACK
    rows.append(
        Row(
            "  SQL statements/s across node counts and lateness (the history pruner's apart)",
            ", ".join(f"{w.sql_per_s:.2f}" for w in windows),
            "",
            f"flat (<= {FLAT:g}x the first + {SQL_SLACK:g})",
            verdict(flat_sql),
        )
    )
    for w in windows:
        if w.phase.nodes == FLEET_NODES:
            need = FLEET_NODES / FLEET_PERIOD_S
            covered = 1e6 / w.cpu_us / need
            rows.append(
                Row(
                    f"  {FLEET_NODES:,} nodes every {FLEET_PERIOD_S:g}s: one core at the CPU"
                    f"/heartbeat of the row every {w.phase.period_s:g}s{_batched(w)}",
                    f"{1e6 / w.cpu_us:,.0f} heartbeats/s = {covered:.1f}x the {need:,.0f}/s needed"
                    f" (measured at {w.rate:,.0f}/s)",
                    f"bare ASGI app{' (same batches)' if w.phase.bare_batched else ''}:"
                    f" {1e6 / w.bare_cpu_us / need:.1f}x",
                    f">= {COVERAGE:g}x",
                    verdict(covered >= COVERAGE),
                )
            )
    return rows


def _nodes(w: FleetWindow) -> int:
    return w.phase.nodes
