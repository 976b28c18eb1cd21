"""What a local cluster runs (`supervisor demo`, `supervisor run`): the options of the
job, its nodes and its supervisor. Apart from the cluster itself, so that the command line
reads its defaults without importing what starts processes."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.local.cluster_state import JobSpec
from supervisor.local.preload import preload_of

WORKLOADS = {"numpy": "training.numpy_workload", "torch": "training.torch_workload"}
#: The torch workload's PARALLELISM values.
PARALLELISMS = ("ddp", "fsdp", "hsdp")


@dataclass
class DemoOptions:
    run_dir: Path = Path("var/demo")
    port: int = 8080
    replicas: int = 2
    nodes_per_dp: int = 2
    spares: int = 2
    job: str = "demo"
    seed: int = 0
    total_steps: int = 100_000
    step_time_s: float = 0.1
    in_memory_checkpointing_freq: int = 10
    s3_checkpointing_freq: int = 20
    heartbeat_polling_period_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    #: A worker that reports no progress this long is lost (None: the node's heartbeat
    #: timeout, 2 s at least).
    worker_heartbeat_timeout_s: float | None = None
    node_repair_s: float = 20.0
    policy: str = "policies.default:DefaultPolicy"
    supervisor_env: dict[str, str] = field(default_factory=dict)
    #: `numpy` (the NumPy workload, sharded over `nodes_per_dp` nodes) or `torch` (the
    #: PyTorch workload: DDP, one node per replica).
    workload: str = "numpy"
    #: More environment for the workload (e.g. the torch model's size).
    workload_env: dict[str, str] = field(default_factory=dict)
    #: How the torch workload lays its model over the ranks: `ddp` (replicas), `fsdp`
    #: (FSDP2, sharded over every rank), `hsdp` (FSDP2 on 2 replica groups x the rest).
    parallelism: str = "ddp"
    #: The torch workload heals in-process (restart in place, hot-swap): survivors keep
    #: their processes. Off: every rank restarts.
    in_process_restart: bool = True
    #: Each node of the torch job, and each spare, keeps a warm standby process with torch
    #: imported: a rank started anew (restart in place, hot-swap) skips that import. Your
    #: own Python command's standby imports what its program imports (preload.py).
    warm_standby: bool = True
    #: Your own job instead of the workload (`supervisor run`): the command every worker
    #: runs, with `workload_env` and torchrun's environment.
    command: list[str] | None = None
    #: The command heals in-process (`supervisor run --in-process`): it runs its worlds
    #: through training.healing. Off by default: a script that does not would only be
    #: waited for, up to in_process_restart_timeout_s, before every rank restarts.
    command_in_process: bool = False
    #: Workers per node (torchrun's --nproc-per-node).
    nproc_per_node: int = 1
    #: Where each process runs, by name (`supervisor`, or a node's): the command prefix
    #: that runs it there (e.g. `ip netns exec NS`, a host with a network of its own) and
    #: the address it binds and is reached at. Left out: this machine, on 127.0.0.1.
    hosts: dict[str, tuple[list[str], str]] = field(default_factory=dict)

    def host(self, name: str) -> tuple[list[str], str]:
        return self.hosts.get(name, ([], "127.0.0.1"))

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {self.workload!r}")
        if self.parallelism not in PARALLELISMS:
            raise ValueError(
                f"parallelism must be one of {', '.join(PARALLELISMS)}, got {self.parallelism!r}"
            )
        if self.parallelism != "ddp" and self.workload != "torch":
            raise ValueError(f"parallelism {self.parallelism} needs the torch workload")
        if self.workload == "torch" and self.nodes_per_dp != 1:
            raise ValueError(
                "nodes_per_dp must be 1 with the torch workload: it is data parallel (DDP), "
                "each node holds a whole replica"
            )

    @property
    def nodes(self) -> list[str]:
        return [f"node-{i}" for i in range(self.replicas * self.nodes_per_dp + self.spares)]

    def job_spec(self, placement: list[str]) -> JobSpec:
        """The job of the local cluster on `placement`: the command, else the workload."""
        if self.command is not None:
            return JobSpec(
                name=self.job,
                command=self.command,
                env=self.workload_env,
                num_dp_replicas=self.replicas,
                num_nodes_per_dp=self.nodes_per_dp,
                placement=placement,
                nproc_per_node=self.nproc_per_node,
                in_process_restart=self.command_in_process,
                standby_preload=preload_of(self.command) if self.warm_standby else [],
            )
        return JobSpec(
            name=self.job,
            command=[sys.executable, "-m", WORKLOADS[self.workload]],
            env={
                "SEED": str(self.seed),
                "TOTAL_STEPS": str(self.total_steps),
                "STEP_TIME_S": str(self.step_time_s),
                "IN_MEMORY_CHECKPOINTING_FREQ": str(self.in_memory_checkpointing_freq),
                "S3_CHECKPOINTING_FREQ": str(self.s3_checkpointing_freq),
                **({"PARALLELISM": self.parallelism} if self.workload == "torch" else {}),
                # A scale-down trains on every batch of a step still (elastic.py): the
                # weights stay those of the full job's run.
                **(
                    {"DATA_REPLICAS": str(self.replicas)}
                    if self.workload == "torch" and self.parallelism == "ddp"
                    else {}
                ),
                # A sharded rank left waiting in another mesh group's collective (HSDP)
                # must fail well within the in-process restart's bound to rejoin.
                **({"COLLECTIVE_TIMEOUT_S": "8"} if self.parallelism != "ddp" else {}),
                **self.workload_env,
            },
            num_dp_replicas=self.replicas,
            num_nodes_per_dp=self.nodes_per_dp,
            placement=placement,
            in_process_restart=self.workload == "torch" and self.in_process_restart,
            standby_preload=(
                ["training.torch_workload.train"]
                if self.workload == "torch" and self.warm_standby
                else []
            ),
        )
