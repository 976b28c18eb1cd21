"""`supervisor simulate` at fleet scale: simulated seconds per wall second.

Each size runs a failure mix of a few hundred faults (the same rate per node-hour for
every size) with the default policy, and beside it the same cluster with no faults:
the cost of the faults themselves (events, policy, store, actions) is the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.simulate.cluster import SimulatedCluster
from supervisor.simulate.runner import RunResult, run_variant, scenario_faults
from supervisor.simulate.scenario import load_scenario

#: Failures per node-hour, by cause: ~300 faults for 2,048 nodes over 54 days.
RATES = {
    "host": 4e-5,
    "gpu": 3e-5,
    "gpu_memory": 1e-5,
    "software": 2.5e-5,
    "hang": 5e-6,
    "network": 3e-6,
}
NODES_PER_REPLICA = 16


@dataclass(frozen=True)
class SimulateResult:
    nodes: int
    days: float
    faulty: RunResult
    quiet: RunResult

    @property
    def rate(self) -> float:
        """Simulated seconds per wall second, with the faults."""
        return self.faulty.simulated_s / self.faulty.wall_s

    @property
    def quiet_rate(self) -> float:
        return self.quiet.simulated_s / self.quiet.wall_s


def run(nodes: int, days: float) -> SimulateResult:
    replicas = nodes // NODES_PER_REPLICA
    spares = max(2, nodes // 50)
    cluster = {
        "num_dp_replicas": replicas,
        "num_nodes_per_dp": NODES_PER_REPLICA,
        "spares": spares,
        "min_num_dp_replicas": max(1, replicas - 8),
    }
    faulty = load_scenario(
        None,
        days=days,
        seed=1,
        cluster=cluster,
        failures={"rates": RATES},
        settings={"enable_workload_scaling": True},
    )
    names = list(SimulatedCluster(faulty, []).nodes)
    faults = scenario_faults(faulty, names)
    quiet = load_scenario(
        None, days=days, seed=1, cluster=cluster, settings={"enable_workload_scaling": True}
    )
    return SimulateResult(
        nodes=len(names),
        days=days,
        faulty=run_variant(faulty, faults, "default", {}),
        quiet=run_variant(quiet, [], "no faults", {}),
    )
