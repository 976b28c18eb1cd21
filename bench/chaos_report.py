"""The chaos run's rows in `python -m bench` (`--only chaos`): one run per workload,
NumPy and PyTorch, then the PyTorch job again with network faults as well (every host in
a network namespace of its own, bench/chaos_network.py), as DDP and as HSDP, each judged
on its own (bench/chaos.py)."""

from __future__ import annotations

from typing import Any

from bench import chaos, chaos_network
from bench.table import Row, verdict

WORKLOADS = ("numpy", "torch")
#: With network faults: the DDP job, then the HSDP one (2 replica groups of 2 shards).
#: Four ranks and six host monitors on two cores get 60 s for an in-process join (as the
#: HSDP MTTR rows do), and one that fails restarts every rank after it: the stall watch
#: waits 9 hang timeouts (90 s) before calling that a stall; the job gets 20 minutes to
#: finish after the window.
NETWORK_LAYOUTS: tuple[dict[str, Any], ...] = (
    {"workload": "torch", "nodes_per_dp": 1},
    {
        "workload": "torch",
        "nodes_per_dp": 1,
        "replicas": 4,
        "parallelism": "hsdp",
        "scaling": False,  # its weights are compared: its world stays 2x2
        "stall_hang_timeouts": 9.0,
        # It trains slower than step_time_s says: 4,701 of 4,800 steps in the 12 minutes
        # a 4-minute run gave it to finish.
        "finish_timeout_s": 1200.0,
    },
)


def chaos_rows(minutes: float) -> list[Row]:
    rows: list[Row] = []
    for workload in WORKLOADS:
        nodes_per_dp = 1 if workload == "torch" else 2  # the torch job is data parallel
        config = chaos.ChaosConfig(minutes=minutes, workload=workload, nodes_per_dp=nodes_per_dp)
        rows += _rows(config, chaos.run(config))
    why_not = chaos_network.unavailable()
    if why_not is not None:
        rows.append(Row("Chaos (torch) with network faults", "not run", why_not, verdict="info"))
        return rows
    for layout in NETWORK_LAYOUTS:
        config = chaos.ChaosConfig(minutes=minutes, network_faults=True, **layout)
        result = chaos.run(config)
        rows += _rows(config, result) + _network_rows(config, result)
    return rows


def _network_rows(config: chaos.ChaosConfig, result: chaos.ChaosResult) -> list[Row]:
    faults = result.network
    kinds: dict[str, int] = {}
    for fault in faults:
        kinds[fault.kind] = kinds.get(fault.kind, 0) + 1
    failed = [f for f in faults if not f.verdict.healed]
    undetected = [f for f in faults if not f.detected and not f.already_lost]
    stale = result.stale_reports
    rows = [
        Row(
            f"  network faults (mean {config.network_mean_interval_s:g} s apart, "
            f"{chaos_network.DURATION_S[0]:g}-{chaos_network.DURATION_S[1]:g} s each): "
            "seen by the supervisor, and healed",
            f"{sum(1 for f in faults if f.detected and f.verdict.healed)} of "
            f"{sum(1 for f in faults if f.detected or not f.already_lost)} "
            f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items())) or 'none'})"
            + (f"; {result.network_error}" if result.network_error else ""),
            f"events on the node, cut or within {chaos_network.AFTERMATH_S:g} s of the heal; "
            "the job's actions then judged as the supervisor's own faults'",
            "all",
            verdict(bool(faults) and not failed and not undetected and not result.network_error),
        ),
        Row(
            "  an older world's reports refused / dropped (heartbeats; checkpoints)",
            f"{stale.get('heartbeat refused', 0):g} / {stale.get('heartbeat dropped', 0):g}; "
            f"{stale.get('checkpoint refused', 0):g} / {stale.get('checkpoint dropped', 0):g}",
            "none of them applied",
        ),
    ]
    for fault in undetected:
        rows.append(Row(f"  undetected: {fault.kind} on {fault.node}", "-", verdict="FAIL"))
    for fault in faults:
        if fault.already_lost and not fault.detected:
            rows.append(
                Row(f"  {fault.kind} on {fault.node}: cut while already lost, nothing new", "-")
            )
    for fault in failed:
        why = fault.verdict.why_not
        rows.append(Row(f"  not healed: {fault.kind} on {fault.node}: {why}", "-", verdict="FAIL"))
    for fault in faults:
        if fault.verdict.healed and fault.verdict.healed_by is not None:
            rows.append(
                Row(f"  {fault.kind} on {fault.node}: healed by {fault.verdict.healed_by}", "-")
            )
    unsaved = [
        f"{f.kind} on {f.node}: {error}"
        for f in faults
        for error in f.verdict.checkpoints_not_committed
    ]
    rows.append(
        Row(
            "  emergency checkpoints that did not commit while a link was cut (reported)",
            str(len(unsaved)),
        )
    )
    return rows + [Row(f"    {why}", "-") for why in unsaved]


def _rows(config: chaos.ChaosConfig, result: chaos.ChaosResult) -> list[Row]:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(result.by_kind.items())) or "none"
    all_healed = result.injected > 0 and result.remediated == result.injected
    rows = [
        Row(
            f"Chaos ({config.title}), {config.minutes:g} min of random faults (mean "
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
            f"an uninterrupted run, same seed, {config.total_steps} steps"
            + (f"; logs kept in {result.kept}" if result.kept else ""),
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
    rows += [
        Row(f"  its own remedy failed, healed by a later one: {how}", "-")
        for how in result.healed_later
    ]
    rows.append(
        Row(
            "  emergency checkpoints that did not commit (reported; the remedy went on)",
            str(len(result.checkpoints_not_committed)),
        )
    )
    rows += [Row(f"    {why}", "-") for why in result.checkpoints_not_committed]
    return rows
