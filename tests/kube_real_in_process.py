"""The chart's example PyTorch JobSet (helm/.../jobset-pytorch.yaml: annotated to heal
in-process, its Jobs replacing a lost pod alone) on the real control plane
(tests/kube_real_fixtures.py): nodes of the test's pool, the supervisor as the chart's
ServiceAccount, a real host monitor per node with the peer checkpoint tier on, and the
pods run as `python -m training.pod_launch ... -m training.torch_workload` (DDP on gloo)
by the kubelet of tests/kube_real_kubelet.py. MASTER_ADDR is 127.0.0.1 (no cluster DNS
here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from supervisor.kube import objects as o
from supervisor.local.ports import free_port
from tests.control_plane import ControlPlane, Identity
from tests.http import http
from tests.kube_real_fixtures import (
    HEARTBEAT_PERIOD_S,
    REPO,
    WORKER_HEARTBEAT_TIMEOUT_S,
    RealPlaneEnv,
    as_applied,
    healing_env,
    wait_for,
)
from tests.test_host_monitor import ACTUATOR_TOKEN
from tests.test_torch_emergency import SMALL
from tests.timing import scaled

EXAMPLE = REPO / "helm" / "resiliency-supervisor" / "examples" / "jobset-pytorch.yaml"
PEER_TOKEN = "in-process-peer-token"
TOTAL_STEPS = 110  # the last fault is near step 70; the rest only trains to the end
#: The ports kept for the JobSet's rendezvous: world n's is MASTER_PORT + n (a test reaches
#: world 3 at most), and one of them handed to another test's server failed a heal.
WORLD_PORTS = 8
#: The label of the test's JobSet, which its supervisor selects (and no other test's).
SELECTOR = "in-process-test"
#: How long a rank may take for its emergency save, and the supervisor for the whole
#: emergency checkpoint (the product's defaults: 60 s), as margins: a rank started in a
#: replacement pod waits for its first periodic save to end before its emergency one, and
#: a process's first save took over 6 s beside the rest of the suite on 2 cores.
RANK_EMERGENCY_TIMEOUT_S = scaled(12.0)
EMERGENCY_TIMEOUT_S = scaled(15.0)


def jobset(tmp: Path, name: str, master_port: int, nproc: int = 1) -> dict[str, Any]:
    """The chart's example PyTorch JobSet named `name`, with host paths (the RAM tier one
    directory per node, under its host monitor's checkpoint_root), a small model, short
    steps and `nproc` ranks per pod."""
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["annotations"]["resiliency.supervisor.io/nproc-per-node"] = str(nproc)
    pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    overrides = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "CHECKPOINT_RAM_DIR": str(tmp / "nodes" / "$(NODE_NAME)" / "ram" / name),
        "CHECKPOINT_DURABLE_DIR": str(tmp / "shared" / "durable"),
        "OUTPUT_DIR": str(tmp / "shared" / "output"),
        "TOTAL_STEPS": str(TOTAL_STEPS),
        "IN_MEMORY_CHECKPOINTING_FREQ": "10",
        # Two RAM copies: the partner's newest copy may lag one save behind a node's own.
        "RAM_TOPK_CKPT": "2",
        "S3_CHECKPOINTING_FREQ": "50",
        "STEP_TIME_S": "0.05",
        "LOG_EVERY_STEPS": "10",
        # How long a rank waits for its new world, scaled as a margin: a replacement's
        # rank that gives up first ends the in-process heal (a full restart instead).
        "PEER_LOSS_WAIT_S": str(scaled(60)),
        "WORLD_WAIT_S": str(scaled(60)),
        "EMERGENCY_CHECKPOINT_TIMEOUT_S": str(RANK_EMERGENCY_TIMEOUT_S),
        "SYNC_FILES": "false",
        "OMP_NUM_THREADS": "1",
        "NPROC_PER_NODE": str(nproc),
        **SMALL,
    }
    for var in container["env"]:
        if var["name"] in overrides:
            var["value"] = overrides.pop(var["name"])
    node_name = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    container["env"] = [node_name, *container["env"]]
    container["env"] += [{"name": k, "value": v} for k, v in overrides.items()]
    return body


class RealInProcess(RealPlaneEnv):
    """`count` nodes (one per replica, the rest spares), the peer tier on, and the
    PyTorch JobSet `pretrain-torch-<tag>` of `nproc` ranks per pod; `policy`, the source
    of a policy class `WithoutEmergencyCheckpoints` the supervisor runs instead of the
    default."""

    def __init__(
        self, plane: ControlPlane, who: Identity, tmp: Path, tag: str, *, nproc: int = 1,
        count: int = 4, policy: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            plane, who, tmp, tag, job=f"pretrain-torch-{tag}", prefix="ip", count=count
        )
        self.nproc = nproc
        self.policy = policy

    def supervisor_env(self) -> dict[str, str]:
        env = {
            **super().supervisor_env(),
            "SUPERVISOR_KUBE_JOBSET_SELECTOR": f"{SELECTOR}={self.pool}",
            **healing_env(nodes_per_dp=1, action_timeout_s=150),
            "SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "100",
            "SUPERVISOR_EMERGENCY_CHECKPOINT_TIMEOUT_S": str(EMERGENCY_TIMEOUT_S),
            # Four ranks and their host monitors share this machine's 2 cores: a rank
            # 10% slower than the others for 30 s is CPU contention here, not the fault
            # under test (stragglers are scored from 3 ranks on).
            "SUPERVISOR_STRAGGLER_THRESHOLD": "5",
        }
        if self.policy is not None:
            path = self.tmp / "policy.py"
            path.write_text(self.policy)
            env["SUPERVISOR_POLICY"] = f"{path}:WithoutEmergencyCheckpoints"
        return env

    def agent_flags(self, node: str) -> dict[str, Any]:
        return {
            "heartbeat_polling_period_s": HEARTBEAT_PERIOD_S,
            "worker_heartbeat_timeout_s": WORKER_HEARTBEAT_TIMEOUT_S,
            # How long a stopped worker's state stays to be read: a margin of the
            # test's, scaled with the others.
            "idle_release_s": scaled(2.0),
            "checkpoint_root": self.tmp / "nodes" / node / "ram",
            "peer_store_dir": self.tmp / "nodes" / node / "peer",
            "env": {"HOST_MONITOR_PEER_TOKEN": PEER_TOKEN},
        }

    def jobset(self) -> dict[str, Any]:
        """The example as a user applies it (tests/kube_real_fixtures.py), selected by
        the test's supervisor alone."""
        port = free_port(span=WORLD_PORTS)
        body = jobset(self.tmp, self.job, master_port=port, nproc=self.nproc)
        body = as_applied(body, self.job, self.pool, self.tmp)
        body["metadata"]["labels"][SELECTOR] = self.pool
        return body

    # --- what a user looks at -------------------------------------------------------------

    def ranks(self) -> dict[int, dict[str, Any]]:
        """Running pods of the JobSet by rank (job index: one node per replica)."""
        return {int(p["metadata"]["labels"][o.JS + "job-index"]): p for p in self.pods()}

    def restarts(self) -> int:
        return int((self.jobset_now().get("status") or {}).get("restarts") or 0)

    def process(self, pod: dict[str, Any]) -> int | None:
        container = self.bridge.containers.get(pod["metadata"]["uid"])
        return container.proc.pid if container is not None else None

    def rank_processes(self, pod: dict[str, Any]) -> dict[int, int]:
        """rank -> pid of the ranks the pod's launcher started (training.pod_launch)."""
        launcher = self.process(pod)
        if launcher is None:
            return {}
        out = {}
        children = Path(f"/proc/{launcher}/task/{launcher}/children")
        try:
            listed = children.read_text()
        except FileNotFoundError:  # the launcher ended: say how, and what the pod logged
            container = self.bridge.containers.get(pod["metadata"]["uid"])
            code = container.proc.poll() if container is not None else None
            raise AssertionError(
                f"the launcher of pod {pod['metadata']['name']} (pid {launcher}) ended with "
                f"{code}:\n{self.log_of(pod)[-3000:]}"
            ) from None
        for pid in map(int, listed.split()):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            env = dict(v.decode().split("=", 1) for v in environ if b"=" in v)
            out[int(env["RANK"])] = pid
        return out

    def log_of(self, pod: dict[str, Any]) -> str:
        path = self.tmp / "pods" / f"{pod['metadata']['name']}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def weights(self) -> str | None:
        path = self.tmp / "shared" / "output" / "weights.sha256"
        return path.read_text() if path.exists() else None

    def partner(self, node: str) -> str | None:
        agent = self.agents[node]
        r = http.get(
            f"{agent.url}/v1/checkpoint-peer",
            headers={"Authorization": f"Bearer {ACTUATOR_TOKEN}"},
            timeout=5,
        )
        r.raise_for_status()
        peer = r.json().get("peer")
        return peer["node"] if peer else None


def training(env: RealInProcess, past: int) -> dict[int, dict[str, Any]]:
    """Both ranks run and the job is past step `past`."""
    pods: dict[int, dict[str, Any]] = wait_for(
        lambda: len(env.ranks()) == 2 and env.ranks(), 60, "two pods running"
    )
    wait_for(lambda: env.step() >= past, 90, f"step {past}")
    return pods
