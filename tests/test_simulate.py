"""`supervisor simulate`: the real supervisor on a virtual clock against a simulated
cluster; its goodput against the closed-form model of `supervisor advise`, traces
(written by `supervisor export-trace` from a real store), runs side by side."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from supervisor.domain import Event, EventType, utcnow
from supervisor.goodput.advice import TierInput, advise
from supervisor.simulate.clock import SimulationStalled, run_virtual
from supervisor.simulate.cluster import SimulatedCluster
from supervisor.simulate.fault_sources import Fault, TraceError, parse_trace, sample_mix
from supervisor.simulate.runner import run_variant, scenario_faults
from supervisor.simulate.scenario import ScenarioError, load_scenario
from supervisor.store import open_store

SUPERVISOR = [sys.executable, "-m", "supervisor.cli"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    return subprocess.run(
        [*SUPERVISOR, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, **(env or {})},
    )


def test_virtual_clock_runs_timers_without_sleeping() -> None:
    async def main() -> tuple[float, datetime, int]:
        loop = asyncio.get_running_loop()
        for _ in range(1000):
            await asyncio.sleep(3600)
        async with asyncio.timeout(10):
            value = await asyncio.to_thread(lambda: 7)
        return loop.time(), utcnow(), value

    now, wall, value = run_virtual(main(), epoch=1_000_000.0)
    assert now == pytest.approx(3_600_000.0)
    assert wall == datetime.fromtimestamp(1_000_000.0 + 3_600_000.0, UTC)
    assert value == 7
    assert abs((utcnow() - datetime.now(UTC)).total_seconds()) < 5  # the real clock again

    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationStalled):
        run_virtual(forever(), epoch=0.0)


def test_goodput_agrees_with_the_closed_form_model() -> None:
    """Periodic checkpoints of one tier, exponential failures, a fixed restart cost:
    what `supervisor advise` computes, within 2 points."""
    save_s, every_s, step_s = 30.0, 1800.0, 2.0
    mtbf_s = 4 * 3600.0
    restart_s, restore_s = 30.0, 60.0
    nodes = 4
    scenario = load_scenario(
        None,
        days=30,
        seed=7,
        cluster={"num_dp_replicas": 2, "num_nodes_per_dp": 2, "spares": 0, "gpus_per_node": 1},
        job={
            "step_s": step_s,
            "tiers": [
                {
                    "name": "durable",
                    "every_s": every_s,
                    "save_s": save_s,
                    "restore_s": restore_s,
                    "survives": "all",
                }
            ],
            "in_place_restart_s": restart_s,
            "startup_s": restart_s,
        },
        failures={"rates": {"software": 3600.0 / mtbf_s / nodes}},
        settings={
            "policy": "policies.examples.periodic_checkpoints_only:PeriodicCheckpointsOnly",
            "max_in_job_restarts": 1_000_000,
            "max_restarts_in_window": 1_000_000,
        },
    )
    names = list(SimulatedCluster(scenario, []).nodes)
    faults = scenario_faults(scenario, names)
    assert 150 < len(faults) < 210  # 30 days at one failure every 4 hours
    result = run_variant(scenario, faults, "periodic", {})
    model = advise(
        step_s,
        TierInput("durable", save_s, current_interval_steps=int(every_s / step_s)),
        mtbf_s=mtbf_s,
        downtime_per_failure_s=restart_s + restore_s,
    )
    assert model.expected_goodput_current is not None
    assert result.actions["restart_in_place"]["succeeded"] == result.counters.faults_applied
    assert result.goodput.goodput == pytest.approx(model.expected_goodput_current, abs=0.02)
    # And the breakdown adds up: productive plus every badput category is the wall time.
    g = result.goodput
    assert g.productive_s + g.badput.total_s == pytest.approx(g.wall_s, rel=1e-6)
    assert g.badput.lost_progress_s > 0 and g.badput.restart_s > 0


def _small(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "days": 3,
        "seed": 3,
        "cluster": {
            "num_dp_replicas": 4,
            "num_nodes_per_dp": 2,
            "spares": 2,
            "min_num_dp_replicas": 2,
            "repair_s": 7200,
        },
        "settings": {"enable_workload_scaling": True},
    }
    base.update(overrides)
    return base


def test_node_losses_are_hot_swapped_and_repaired_nodes_come_back(tmp_path: Path) -> None:
    trace = tmp_path / "faults.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(line)
            for line in [
                {"time": 3600, "node": "gpu-a", "kind": "node_down"},
                {"time": 7300, "node": "gpu-b", "kind": "gpu_xid", "details": {"code": 79}},
                {"time": 20000, "node": "gpu-c", "kind": "worker_crash"},
                {"time": 30000, "node": "gpu-d", "kind": "worker_hang"},
            ]
        )
        + "\n"
    )
    scenario_file = tmp_path / "scenario.yaml"
    scenario_file.write_text(json.dumps(_small(trace="faults.jsonl")))
    done = _cli(
        "simulate",
        "--scenario",
        str(scenario_file),
        "-o",
        "json",
        "--html",
        str(tmp_path / "chart.html"),
    )
    assert done.returncode == 0, done.stderr
    run = json.loads(done.stdout)["runs"][0]
    assert run["faults"] == 4 and run["cluster"]["faults_applied"] == 4
    # Two bad nodes swapped for the two spares, both back from repair and uncordoned.
    assert run["actions"]["hot_swap"] == {"succeeded": 2}
    assert run["actions"]["uncordon"] == {"succeeded": 2}
    assert run["cluster"]["spares_used"] == 2 and run["cluster"]["spares_returned"] == 2
    assert run["events"]["host_heartbeat_lost"] == 1 and run["events"]["gpu_xid"] == 1
    assert run["events"]["worker_exited"] == 1 and run["events"]["hang"] == 1
    assert run["actions"]["restart_in_place"] == {"succeeded": 2}
    assert run["failures"] == 4
    assert 0.9 < run["goodput"] < 1.0
    assert run["badput_h"]["detection"] > 0
    page = (tmp_path / "chart.html").read_text()
    assert "<svg" in page and "current" in page


def test_policies_side_by_side_on_the_same_faults(tmp_path: Path) -> None:
    scenario_file = tmp_path / "scenario.yaml"
    scenario_file.write_text(
        json.dumps(
            _small(
                failures={"rates": {"host": 0.004, "software": 0.004, "gpu": 0.002}},
                variants={
                    "default": {},
                    "periodic-only": {
                        "policy": "policies.examples.periodic_checkpoints_only:"
                        "PeriodicCheckpointsOnly"
                    },
                },
            )
        )
    )
    done = _cli(
        "simulate",
        "--scenario",
        str(scenario_file),
        "-o",
        "json",
        "--compare",
        "slow:heartbeat_timeout_s=300",
    )
    assert done.returncode == 0, done.stderr
    runs = {r["name"]: r for r in json.loads(done.stdout)["runs"]}
    assert list(runs) == ["default", "periodic-only", "slow"]
    assert len({r["faults"] for r in runs.values()}) == 1 and runs["default"]["faults"] > 5
    # Emergency checkpoints keep the work done since the last periodic one.
    assert runs["default"]["actions"]["emergency_checkpoint"]["succeeded"] > 0
    assert "emergency_checkpoint" not in runs["periodic-only"]["actions"]
    assert (
        runs["periodic-only"]["badput_h"]["lost_progress"]
        > runs["default"]["badput_h"]["lost_progress"]
    )
    assert runs["default"]["goodput"] > runs["periodic-only"]["goodput"]
    # Detection waits for the heartbeat timeout.
    assert runs["slow"]["badput_h"]["detection"] > runs["default"]["badput_h"]["detection"]
    assert runs["slow"]["settings"] == {"heartbeat_timeout_s": 300.0}
    table = _cli("simulate", "--scenario", str(scenario_file))
    assert table.returncode == 0, table.stderr
    assert "goodput" in table.stdout and "periodic-only" in table.stdout


def test_the_same_seed_gives_the_same_faults_and_results() -> None:
    nodes = [f"n{i}" for i in range(50)]
    kwargs = dict(
        per_gpu=True, nodes=nodes, gpus_per_node=8, duration_s=86400.0 * 5, network_outage_s=30.0
    )
    a = sample_mix({"gpu": 1e-3, "host": 2e-4}, seed=1, **kwargs)  # type: ignore[arg-type]
    b = sample_mix({"gpu": 1e-3, "host": 2e-4}, seed=1, **kwargs)  # type: ignore[arg-type]
    c = sample_mix({"gpu": 1e-3, "host": 2e-4}, seed=2, **kwargs)  # type: ignore[arg-type]
    assert [(f.time, f.node, f.kind) for f in a] == [(f.time, f.node, f.kind) for f in b]
    assert [(f.time, f.node) for f in a] != [(f.time, f.node) for f in c]
    # Per GPU-hour, 8 GPUs a node: (8e-3 + 1.6e-3) x 50 nodes x 120 h ~ 58 faults.
    assert 30 < len(a) < 90
    scenario = load_scenario(None, **_small(failures={"rates": {"host": 0.003}}))
    names = list(SimulatedCluster(scenario, []).nodes)
    one = run_variant(scenario, scenario_faults(scenario, names), "x", {})
    two = run_variant(scenario, scenario_faults(scenario, names), "x", {})
    assert one.goodput.goodput == two.goodput.goodput and one.actions == two.actions


def test_export_trace_from_recorded_history_replays(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    store = open_store(url)
    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    store.record(
        [
            Event(
                EventType.HOST_HEARTBEAT_LOST,
                t0 + timedelta(seconds=15),
                node="n7",
                job="llm",
                details={"last_heartbeat": t0.isoformat()},
            ),
            Event(
                EventType.GPU_XID,
                t0 + timedelta(hours=2),
                node="n3",
                job="llm",
                details={"code": 48, "gpu": 2},
            ),
            Event(
                EventType.WORKER_EXITED,
                t0 + timedelta(hours=3),
                node="n1",
                job="llm",
                details={"exit_code": 0},
            ),  # a clean end is no fault
            Event(EventType.SPARE_AVAILABLE, t0 + timedelta(hours=4), node="n9"),
        ],
        [],
        [],
    )
    store.close()
    done = _cli("export-trace", env={"SUPERVISOR_DATABASE_URL": url})
    assert done.returncode == 0, done.stderr
    faults = parse_trace(done.stdout.splitlines())
    assert [(f.time, f.node, f.kind) for f in faults] == [
        (0.0, "n7", "node_down"),
        (7200.0, "n3", "gpu_xid"),
    ]
    assert faults[1].details["code"] == 48
    (tmp_path / "trace.jsonl").write_text(done.stdout)
    replay = _cli("simulate", "--trace", str(tmp_path / "trace.jsonl"), "--days", "1", "-o", "json")
    assert replay.returncode == 0, replay.stderr
    run = json.loads(replay.stdout)["runs"][0]
    assert run["events"]["host_heartbeat_lost"] == 1 and run["events"]["gpu_xid"] == 1


def test_bad_scenarios_and_traces_are_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"cluster.spares"):
        load_scenario(None, cluster={"spares": -1})
    with pytest.raises(ScenarioError, match=r"failures: rates.cosmic_rays: unknown cause"):
        load_scenario(None, failures={"rates": {"cosmic_rays": 1.0}})
    with pytest.raises(TraceError, match=r"trace:2: kind"):
        parse_trace(
            [
                '{"time": 1, "node": "a", "kind": "node_down"}',
                '{"time": 2, "node": "a", "kind": "meteor"}',
            ]
        )
    with pytest.raises(TraceError, match=r"trace:1: time"):
        parse_trace(['{"time": -1, "node": "a", "kind": "node_down"}'])
    bad = tmp_path / "s.yaml"
    bad.write_text("job: {step_s: 0}\n")
    done = _cli("simulate", "--scenario", str(bad))
    assert done.returncode == 2 and "job.step_s" in done.stderr
    done = _cli("simulate", "--days", "1", "--compare", "x:policy=nowhere:Nothing")
    assert done.returncode == 2 and "nowhere" in done.stderr
    done = _cli("simulate", "--days", "1", "--compare", "x:heartbeat_timeout_s=-5")
    assert done.returncode == 2 and "heartbeat_timeout_s" in done.stderr


def test_trace_node_names_map_onto_the_cluster() -> None:
    faults = [
        Fault(1.0, "real-a", "node_down"),
        Fault(2.0, "real-b", "worker_crash"),
        Fault(3.0, "real-a", "worker_hang"),
        Fault(4.0, "node-00001", "worker_hang"),
    ]
    from supervisor.simulate.fault_sources import map_nodes

    mapped = map_nodes(faults, ["node-00000", "node-00001", "node-00002"])
    assert [f.node for f in mapped] == ["node-00000", "node-00002", "node-00000", "node-00001"]
    with pytest.raises(TraceError, match="more nodes"):
        map_nodes(faults, ["node-00001"])
