"""Which test modules share one xdist worker in `make test`'s second session (`--dist
loadgroup`), run whole and one after another: the modules on the real control plane (one
plane per worker would start the session's plane twice), and the small torch modules (so
that at most two training modules run at once, the heavy session's and one of these).
Every other module is a group of its own, whole on one worker, in its order.

xdist's own `loadgroup` reads `xdist_group` marks into the tests' node ids, which pytest 9
no longer lets a plugin change: every test went out on its own, and a module's tests that
share a module-scoped fixture landed on both workers (a peer's newest world, set by the
module's first test, was unknown to its third). `GroupScheduling` groups by module name
instead.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from xdist.scheduler import LoadScopeScheduling

PLANE_GROUP = "control-plane"
SIDE_TORCH_GROUP = "side-torch"

#: The modules whose tests use the `control_plane` fixture (tests/conftest.py checks it).
PLANE_MODULES = frozenset(
    {
        "test_agent_identity_real",
        "test_control_plane",
        "test_dry_run_real",
        "test_helm_install_real",
        "test_kube_backend_real",
        "test_kube_backend_resume_real",
        "test_kube_e2e_real",
        "test_kube_e2e_real_restarts",
        "test_kube_emergency_real",
        "test_kube_in_process",
        "test_kube_informer_real",
        "test_kube_lifecycle",
        "test_kube_sensing_real",
        "test_kube_without_jobset_real",
        "test_kube_worlds_real",
        "test_leader_election_real",
        "test_partitions_kube",
        "test_remedy_state_failover",
    }
)

#: Modules that train too, with small ranks that mostly wait (for a lease, a step's pace,
#: a fault), or that only train and compare weights (no timing margin to break): they run
#: in the second session, one at a time, beside the heavy session.
SIDE_TORCH_MODULES = frozenset(
    {
        "test_auto_progress_run",
        "test_ddp_resume_order",
        "test_fsdp1_checkpoint",
        "test_lightning_checkpoint",
        "test_partitions_lease",
        "test_sharded_checkpoint",
        "test_torch_emergency",
        "test_torch_workload",
    }
)

#: The modules that train with several torch processes at once (`-m heavy`): `make test`
#: runs them in a session of their own, beside the other modules' session, on two workers,
#: each taking one of these groups and running its modules one after another. At most
#: two of them train at once, and each pair sets one bound by its CPU (the sharded and
#: partitioned jobs: about a core each) beside one that mostly waits (for a heartbeat
#: timeout, a restart, a step's pace: half a core or less). All of them on one worker
#: had made that session the suite's longest, with a third of the cores idle.
HEAVY_GROUPS = {
    "heavy-cpu": frozenset(
        {
            "test_checkpoint_tiers",
            "test_fsdp2_example",
            "test_partitions",
            "test_run_user_job",
            "test_sharded_local_cluster",
        }
    ),
    "heavy-waits": frozenset(
        {
            "test_in_process_restart",
            "test_kube_in_process",
            "test_local_cluster",
        }
    ),
}

#: Modules that train nothing and mostly wait (a real S3 server's outages, supervisors'
#: leases and epochs, a job's end), run by the heavy session's workers after their group's
#: own modules, so that both sessions end together. Left in the other session, they kept it
#: running alone for its last 340 s, the cores 40-70 % busy (the clean-clone run of
#: 2026-12-04: the other session 1,328 s, the heavy one 984 s). Each goes where the sum
#: of its group is least; none needs a server the heavy session would start anew
#: (PostgreSQL, Chromium).
HEAVY_SESSION_FILL = {
    "heavy-cpu": frozenset({"test_job_end", "test_leader_epochs_local"}),
    "heavy-waits": frozenset({"test_durable_object_store", "test_leader_election"}),
}

#: Every module of the heavy session (`-m heavy`), by the worker's group that runs it.
HEAVY_SESSION = {
    group: modules | HEAVY_SESSION_FILL.get(group, frozenset())
    for group, modules in HEAVY_GROUPS.items()
}

#: The groups sent out first, so that a worker is not left with one of them at the end
#: while the other idles.
FIRST = (*HEAVY_GROUPS, SIDE_TORCH_GROUP, PLANE_GROUP)


def group_of(module: str) -> str:
    for group, modules in HEAVY_SESSION.items():
        if module in modules:
            return group
    if module in PLANE_MODULES:
        return PLANE_GROUP
    return SIDE_TORCH_GROUP if module in SIDE_TORCH_MODULES else module


def order_of(module: str) -> tuple[int, bool]:
    """Where the module's tests go in the session: by group, its fill last."""
    group = group_of(module)
    filler = module in HEAVY_SESSION_FILL.get(group, frozenset())
    return (FIRST.index(group) if group in FIRST else len(FIRST), filler)


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
    """xdist's scheduling by scope, a scope being a module's group."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(PurePosixPath(nodeid.split("::", 1)[0]).stem)
