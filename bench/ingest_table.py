"""The heartbeat-ingest rows of the bench's table (bench/ingest.py measures)."""

from __future__ import annotations

import math

from bench import ingest
from bench.table import Row, verdict
from supervisor.config import Settings

INGEST_TARGET_PCT = 60.0


def ingest_rows(config: ingest.IngestConfig, period_s: float | None = None) -> list[Row]:
    """The rows of one ingest run; with `period_s`, one more: whether the throughput
    measured covers `config.nodes` heartbeating every `period_s` (the rate a fleet of
    that size sends)."""
    cmp = ingest.run(config)
    sup, bare = cmp.supervisor, cmp.bare
    ratios = sorted(cmp.ratios)
    # The steady heartbeat path writes nothing. The one write while nodes heartbeat is the
    # goodput sampler's: a row per job whose step moved, once per goodput_sample_period_s
    # (Settings' default; the bench's one job), whatever the number of heartbeats.
    changed = sup.db_changed or {}
    period = Settings.model_fields["goodput_sample_period_s"].default
    samples_allowed = math.ceil((sup.db_watched_s or 0.0) / period) + 1
    others = {t: n for t, n in changed.items() if t != "progress_samples"}
    samples = changed.get("progress_samples", 0)
    clean = sup.events_rows == 0 and not others and samples <= samples_allowed
    errors = sup.errors + bare.errors
    conns = f"{config.connections} conns, {config.nodes:,} nodes, {config.rounds} rounds"
    rows = [
        Row(
            f"Heartbeat ingest, HTTP ({conns})",
            f"{sup.rps:,.0f} req/s = {cmp.pct:.1f}% of ceiling (median of rounds)",
            f"bare ASGI app: {bare.rps:,.0f} req/s",
            f">= {INGEST_TARGET_PCT:.0f}% of ceiling",
            verdict(cmp.pct >= INGEST_TARGET_PCT and errors == 0),
        ),
        Row(
            "  per-round ratio min / max",
            f"{100 * ratios[0]:.1f}% / {100 * ratios[-1]:.1f}%" if ratios else "-",
        ),
        Row(
            "  server CPU per request (user + system)",
            f"{sup.cpu_us_per_request:.1f} us = {cmp.cpu_pct:.1f}% of ceiling",
            f"{bare.cpu_us_per_request:.1f} us",
        ),
        Row(
            "  latency p50 / p99",
            f"{sup.p50_ms:.2f} / {sup.p99_ms:.2f} ms",
            f"{bare.p50_ms:.2f} / {bare.p99_ms:.2f} ms",
        ),
        Row(
            "  CPU during window: server / client",
            f"{sup.server_cpu_pct:.0f}% / {sup.client_cpu_pct:.0f}%",
            f"{bare.server_cpu_pct:.0f}% / {bare.client_cpu_pct:.0f}%",
        ),
        Row(
            "  SQL writes during windows",
            f"{sup.events_rows} event rows, {samples} goodput sample rows"
            + (f", other tables CHANGED: {others}" if others else ", nothing else")
            + f" over {sup.requests:,} heartbeats in {sup.db_watched_s or 0:.0f}s",
            f"{sup.nodes_rows} node rows written at registration; the learned step interval"
            f" {_seconds(sup.learned_interval_s[0])} -> {_seconds(sup.learned_interval_s[1])}"
            " (written when it grows)",
            f"0 per heartbeat (<= {samples_allowed} sample rows: 1 per {period:g}s)",
            verdict(clean),
        ),
    ]
    if period_s is not None:
        need = config.nodes / period_s
        rows.append(
            Row(
                f"  {config.nodes:,} nodes every {period_s:g}s need",
                f"{need:,.0f} req/s: {sup.rps / need:.1f}x covered by one supervisor process",
                "",
                ">= 1x",
                verdict(sup.rps >= need),
            )
        )
    if errors:
        rows.append(Row("  request errors", f"{sup.errors} / {bare.errors}", verdict="FAIL"))
    return rows


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"
