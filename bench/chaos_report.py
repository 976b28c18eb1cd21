"""The chaos run's rows in `python -m bench` (`--only chaos`): one run per workload,
NumPy and PyTorch, each judged on its own (bench/chaos.py)."""

from __future__ import annotations

from bench import chaos
from bench.table import Row, verdict

WORKLOADS = ("numpy", "torch")


def chaos_rows(minutes: float) -> list[Row]:
    rows: list[Row] = []
    for workload in WORKLOADS:
        nodes_per_dp = 1 if workload == "torch" else 2  # the torch job is data parallel
        config = chaos.ChaosConfig(minutes=minutes, workload=workload, nodes_per_dp=nodes_per_dp)
        rows += _rows(config, chaos.run(config))
    return rows


def _rows(config: chaos.ChaosConfig, result: chaos.ChaosResult) -> list[Row]:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(result.by_kind.items())) or "none"
    all_healed = result.injected > 0 and result.remediated == result.injected
    rows = [
        Row(
            f"Chaos ({config.workload}), {config.minutes:g} min of random faults (mean "
            f"{config.mean_interval_s:g} s apart) on the local cluster ({config.replicas} x "
            f"{config.nodes_per_dp} nodes, {config.spares} spares): faults remediated",
            f"{result.remediated} of {result.injected} ({kinds})"
            + (f"; {result.error}" if result.error else ""),
            f"{result.refused} refused by the node (its worker already down)",
            "all",
            verdict(all_healed and result.error is None and result.stalled is None),
        ),
        Row(
            "  job stalled (no progress for "
            f"{config.stall_hang_timeouts:g} hang timeouts, unfinished)",
            "no" if result.stalled is None else f"yes: {result.stalled}",
            f"last step {result.final_step}",
            "no",
            verdict(result.stalled is None),
        ),
        Row(
            "  final weights, bit for bit",
            "match"
            if result.weights_match
            else ("differ" if result.weights_match is False else "the job did not finish"),
            f"an uninterrupted run, same seed, {config.total_steps} steps",
            "match",
            verdict(result.weights_match is True),
        ),
        Row(
            "  actions still open at the end (stuck)",
            str(result.stuck_actions),
            "-",
            "0",
            verdict(result.stuck_actions == 0),
        ),
        Row(
            "  processes left after the stop (orphans)",
            str(result.orphans),
            "-",
            "0",
            verdict(result.orphans == 0),
        ),
        Row(
            "  actions taken",
            ", ".join(f"{k} {n}" for k, n in sorted(result.actions.items())) or "none",
        ),
    ]
    rows += [Row(f"  not remediated: {why}", "-", verdict="FAIL") for why in result.not_remediated]
    return rows
