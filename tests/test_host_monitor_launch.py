"""`host-monitor --launch` on two "hosts" (loopback) beside a real `supervisor serve` with
the local backend, as on a Slurm allocation: each host monitor joins the supervisor's
cluster, starts its node's workers running the user's command with torchrun's environment
once both joined, and the supervisor heals a worker killed with SIGKILL by restarting the
job through the host monitors; at the job's end each host monitor exits 0, as torchrun
does. The user's commands are a plain Python script (no PyTorch) that saves a tiny state,
and a shell loop; a command that cannot be found is refused before anything starts, a
host that disagrees with the job is refused naming the field, and the sbatch example of
the docs uses only flags and settings that exist."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from host_monitor import cli as host_monitor_cli
from host_monitor.config import HostMonitorSettings, load_settings
from host_monitor.launch import add_arguments, launch_defaults, launch_of
from supervisor import cli as supervisor_cli
from supervisor.config import Settings
from supervisor.local.ports import free_port
from tests.http import http
from tests.timing import scaled

ROOT = Path(__file__).resolve().parent.parent
AGENT = "agent-token-for-launch-tests"
OPERATOR = "operator-token-for-launch-tests"
ACTUATOR = "actuator-token-for-launch-tests"
HOST_MONITOR = [sys.executable, "-m", "host_monitor.cli"]
#: The ports kept for a job's rendezvous: attempt n's is --master-port + n - 1 (the tests
#: reach attempt 2), each kept from the other tests' servers.
WORLD_PORTS = 8
TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "OMP_NUM_THREADS",
)

# The user's script: records the environment it got (one file per rank and attempt),
# resumes from its saved state, takes steps until STEPS, and saves its state every step.
SCRIPT = """\
import json, os, sys, time
rank = os.environ["RANK"]
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
out = os.environ["OUT_DIR"]
names = NAMES
env = {k: os.environ.get(k) for k in names}
env["pid"] = os.getpid()
state = os.path.join(out, f"state-{rank}.json")
step = json.load(open(state))["step"] if os.path.exists(state) else 0
env["resumed_at"] = step
with open(os.path.join(out, f"env-{rank}-{restart}.json.tmp"), "w") as f:
    json.dump(env, f)
os.replace(os.path.join(out, f"env-{rank}-{restart}.json.tmp"),
           os.path.join(out, f"env-{rank}-{restart}.json"))
print(f"rank {rank} restart {restart} from step {step}", flush=True)
while step < int(os.environ["STEPS"]):
    step += 1
    time.sleep(0.1)
    with open(state + ".tmp", "w") as f:
        json.dump({"step": step}, f)
    os.replace(state + ".tmp", state)
    print(f"rank {rank} step {step}", flush=True)
""".replace("NAMES", repr(TORCHRUN_ENV))

# A job that knows nothing of Python or PyTorch.
SHELL_LOOP = """\
echo "$RANK $GROUP_RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT $$" \\
  > "$OUT_DIR/shell-$RANK-$TORCHELASTIC_RESTART_COUNT.tmp"
mv "$OUT_DIR/shell-$RANK-$TORCHELASTIC_RESTART_COUNT.tmp" \\
  "$OUT_DIR/shell-$RANK-$TORCHELASTIC_RESTART_COUNT"
while true; do sleep 0.2; done
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SUPERVISOR_", "HOST_MONITOR_", "SLURM", "MASTER_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def wait_for(what: str, check: Callable[[], Any], within: float = 60.0) -> Any:
    deadline = time.monotonic() + scaled(within)
    while time.monotonic() < deadline:
        try:
            found = check()
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            found = None
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {within:g}s: {what}")


class Hosts:
    """A `supervisor serve` (local backend, an empty cluster) and host monitors started
    with --launch, each with a log under `tmp`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = tmp / "out"
        self.out.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.tmp / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                args, env=env, cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.procs)

    def serve(self, nnodes: int) -> None:
        env = clean_env(
            SUPERVISOR_BACKEND="local",
            SUPERVISOR_LOCAL_RUN_DIR=str(self.tmp / "supervisor"),
            SUPERVISOR_DATABASE_URL=f"sqlite:///{self.tmp}/supervisor.db",
            SUPERVISOR_AGENT_TOKEN=AGENT,
            SUPERVISOR_OPERATOR_TOKEN=OPERATOR,
            SUPERVISOR_HOST_MONITOR_ACTUATOR_TOKEN=ACTUATOR,
            SUPERVISOR_ENABLE_FAULT_INJECTION="true",
            SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S="0.5",
            SUPERVISOR_HEARTBEAT_TIMEOUT_S="3",
            SUPERVISOR_NUM_DP_REPLICAS=str(nnodes),
            SUPERVISOR_MIN_NUM_DP_REPLICAS=str(nnodes),
            SUPERVISOR_MAX_NUM_DP_REPLICAS=str(nnodes),
            SUPERVISOR_NUM_NODES_PER_DP="1",
            SUPERVISOR_ENABLE_WORKLOAD_SCALING="false",
            SUPERVISOR_LOCAL_STOP_GRACE_S="2",
            SUPERVISOR_ACTION_TIMEOUT_S="60",
        )
        args = [sys.executable, "-m", "supervisor.cli", "serve", "--host", "127.0.0.1"]
        proc = self._spawn("supervisor", [*args, "--port", str(self.port)], env)

        def ready() -> bool:
            assert proc.poll() is None, self.log("supervisor")
            return http.get(f"{self.url}/readyz", timeout=1).status_code == 200

        wait_for("the supervisor ready", ready)

    def launch(self, node: str, flags: list[str], command: list[str], **extra: str) -> None:
        env = clean_env(
            HOST_MONITOR_SUPERVISOR_URL=self.url,
            HOST_MONITOR_AGENT_TOKEN=AGENT,
            HOST_MONITOR_ACTUATOR_TOKEN=ACTUATOR,
            HOST_MONITOR_HEARTBEAT_POLLING_PERIOD_S="0.5",
            HOST_MONITOR_WORKER_HEARTBEAT_TIMEOUT_S="3",
            HOST_MONITOR_KERNEL_LOG="none",
            HOST_MONITOR_RUN_DIR=str(self.tmp / node),
            HOST_MONITOR_CHECKPOINT_ROOT=str(self.tmp / node / "ram"),
            HOST_MONITOR_PEER_STORE_DIR=str(self.tmp / node / "peer"),
            OUT_DIR=str(self.out),
            **extra,
        )
        args = [*HOST_MONITOR, "--node", node, "--port", "0"]
        self._spawn(node, [*args, "--launch", *flags, "--", *command], env)

    def api(self, path: str, **params: Any) -> Any:
        response = http.get(
            f"{self.url}{path}",
            params=params,
            headers={"Authorization": f"Bearer {OPERATOR}"},
            timeout=5,
        )
        response.raise_for_status()
        return response.json()

    def actions(self) -> list[dict[str, Any]]:
        return list(self.api("/api/v1/actions", limit=50)["items"])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    running = Hosts(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def ended(proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
    return lambda: proc.poll() is not None


def envs_of(out: Path, restart: int, ranks: int = 4) -> list[dict[str, Any]] | None:
    """What each rank recorded at start in `restart`; None until every rank has."""
    paths = [out / f"env-{rank}-{restart}.json" for rank in range(ranks)]
    if not all(path.exists() for path in paths):
        return None
    return [json.loads(path.read_text()) for path in paths]


def test_two_hosts_launch_the_user_script_with_torchrun_env_and_a_killed_worker_is_healed(
    hosts: Hosts,
) -> None:
    (hosts.tmp / "train.py").write_text(SCRIPT)
    hosts.serve(nnodes=2)
    master_port = free_port(span=WORLD_PORTS)
    shape = ["--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    for rank in range(2):
        flags = [*shape, "--node-rank", str(rank), "--master-port", str(master_port)]
        hosts.launch(f"node-{rank}", flags, ["train.py"], STEPS="60")

    first = wait_for("every rank started", lambda: envs_of(hosts.out, 0))
    for rank, env in enumerate(first):
        assert {k: env[k] for k in TORCHRUN_ENV} == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % 2),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(rank // 2),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            # torchrun's default for several ranks on a node, unless the user chose one.
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }, hosts.logs()
    # The supervisor knows both nodes and the job the hosts launched.
    wait_for(
        "both nodes known to the supervisor, running the job",
        lambda: {n["name"] for n in hosts.api("/api/v1/nodes", job="job")} == {"node-0", "node-1"},
    )
    cluster = json.loads((hosts.tmp / "supervisor" / "cluster.json").read_text())
    assert cluster["job"]["placement"] == ["node-0", "node-1"], cluster
    assert cluster["job"]["attempt"] == 1

    # A few steps saved by every rank, then rank 3 (node-1's second worker) dies.
    wait_for(
        "every rank past step 3",
        lambda: all(
            json.loads((hosts.out / f"state-{rank}.json").read_text())["step"] >= 3
            for rank in range(4)
        ),
    )
    os.kill(first[3]["pid"], signal.SIGKILL)

    again = wait_for("every rank started again", lambda: envs_of(hosts.out, 1), within=90)
    for rank, env in enumerate(again):
        assert env["RANK"] == str(rank) and env["GROUP_RANK"] == str(rank // 2)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        # A fresh rendezvous port for the new attempt, agreed by both hosts.
        assert env["MASTER_PORT"] == str(master_port + 1)
        assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert env["pid"] != first[rank]["pid"]
        assert env["resumed_at"] >= 3, env  # from the state it saved
    # The restart is recorded as succeeded once the actuator has seen the new attempt's
    # workers: it may still be running when their environments are already written.
    wait_for(
        "the restart recorded as succeeded",
        lambda: [
            a
            for a in hosts.actions()
            if a["type"] in ("restart_in_place", "restart_workload") and a["status"] == "succeeded"
        ],
    )
    # The job's end, as torchrun's: every rank reaches STEPS and exits 0, and each host
    # monitor then exits 0 (so that `srun` returns).
    for node in ("node-0", "node-1"):
        wait_for(f"{node}'s host monitor to exit", ended(hosts.procs[node]), within=120)
        assert hosts.procs[node].returncode == 0, hosts.logs()
    assert all(
        json.loads((hosts.out / f"state-{rank}.json").read_text())["step"] == 60
        for rank in range(4)
    )


def test_a_shell_loop_is_launched_restarted_and_a_missing_command_refused(
    hosts: Hosts,
) -> None:
    (hosts.tmp / "loop.sh").write_text(SHELL_LOOP)
    hosts.serve(nnodes=2)
    master_port = free_port(span=WORLD_PORTS)
    for rank in range(2):
        flags = ["--nnodes", "2", "--node-rank", str(rank), "--master-port", str(master_port)]
        hosts.launch(f"node-{rank}", flags, ["bash", "loop.sh"])

    def started(restart: int) -> list[list[str]] | None:
        paths = [hosts.out / f"shell-{r}-{restart}" for r in range(2)]
        if not all(p.exists() for p in paths):
            return None
        return [p.read_text().split() for p in paths]

    first = wait_for("both shell loops started", lambda: started(0))
    assert [line[:4] for line in first] == [["0", "0", "2", "0"], ["1", "1", "2", "0"]]
    wait_for(
        "the job complete in the supervisor's cluster",
        lambda: json.loads((hosts.tmp / "supervisor" / "cluster.json").read_text())["job"],
    )
    os.kill(int(first[0][4]), signal.SIGKILL)
    again = wait_for("both shell loops started again", lambda: started(1), within=90)
    assert [line[:4] for line in again] == [["0", "0", "2", "1"], ["1", "1", "2", "1"]]

    # A host that disagrees with the job is refused, naming the field; nothing changes.
    join = {
        "node": "node-1",
        "address": "http://127.0.0.1:1",
        "job": "job",
        "command": ["bash", "other.sh"],
        "nnodes": 2,
        "nproc_per_node": 1,
        "node_rank": 1,
        "master_addr": "127.0.0.1",
        "master_port": master_port,
        "attempt": 1,
    }
    agent = {"Authorization": f"Bearer {AGENT}"}
    refused_join = http.post(f"{hosts.url}/api/v1/local/hosts", json=join, headers=agent)
    assert refused_join.status_code == 409, refused_join.text
    assert refused_join.json()["message"].startswith("command: "), refused_join.text
    cluster = json.loads((hosts.tmp / "supervisor" / "cluster.json").read_text())
    assert cluster["job"]["command"] == ["bash", "loop.sh"] and cluster["job"]["attempt"] == 2
    # The same host joining again (its host monitor started again) starts nothing: the
    # supervisor runs the job's attempts now.
    join = {**join, "command": cluster["job"]["command"]}
    join["address"] = cluster["nodes"]["node-1"]["address"]
    again_join = http.post(f"{hosts.url}/api/v1/local/hosts", json=join, headers=agent)
    assert again_join.status_code == 200, again_join.text
    assert again_join.json() == {
        "job": "job",
        "complete": True,
        "attempt": 2,
        "waiting_for": [],
        "start": False,
        "spare": False,
        "finished": False,
    }

    # Not found: one line, a non-zero exit, and nothing started (no node joined).
    refused = subprocess.run(
        [*HOST_MONITOR, "--node", "node-9", "--launch", "--", "no-such-command-for-this-test"],
        env=clean_env(HOST_MONITOR_SUPERVISOR_URL=hosts.url, HOST_MONITOR_AGENT_TOKEN=AGENT),
        cwd=hosts.tmp,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "host-monitor: command not found: no-such-command-for-this-test"
    ]
    assert refused.stdout == ""
    assert "node-9" not in {n["name"] for n in hosts.api("/api/v1/nodes")}


def test_a_lost_host_is_swapped_for_a_spare_host_and_every_host_left_exits_at_the_end(
    hosts: Hosts,
) -> None:
    """Two hosts of the job and two spares (node ranks 2 and 3 of --nnodes 2 --spares 2,
    as the extra nodes of a Slurm allocation): rank 0's host is lost (its host monitor and
    worker killed); the supervisor swaps a spare in, which starts rank 0 again from its
    saved state; at the job's end every host monitor left exits 0, the spare never used
    included (so that `srun` returns)."""
    (hosts.tmp / "train.py").write_text(SCRIPT)
    hosts.serve(nnodes=2)
    master_port = free_port(span=WORLD_PORTS)
    shape = ["--nnodes", "2", "--spares", "2", "--master-port", str(master_port)]
    for rank in range(4):
        flags = [*shape, "--node-rank", str(rank)]
        hosts.launch(f"node-{rank}", flags, ["train.py"], STEPS="120")
    first = wait_for("both ranks started", lambda: envs_of(hosts.out, 0, ranks=2))
    spares = wait_for(
        "both spares known to the supervisor as spares",
        lambda: (
            {n["name"] for n in hosts.api("/api/v1/nodes") if n["state"] == "spare"}
            == {"node-2", "node-3"}
        ),
    )
    assert spares
    wait_for(
        "both ranks past step 3",
        lambda: all(
            json.loads((hosts.out / f"state-{rank}.json").read_text())["step"] >= 3
            for rank in range(2)
        ),
    )
    # node-0 is gone: its host monitor and its worker die together.
    hosts.procs["node-0"].kill()
    os.kill(first[0]["pid"], signal.SIGKILL)

    again = wait_for("both ranks started again", lambda: envs_of(hosts.out, 1, ranks=2), within=90)
    cluster = json.loads((hosts.tmp / "supervisor" / "cluster.json").read_text())
    spare = cluster["job"]["placement"][0]
    assert spare in ("node-2", "node-3") and cluster["job"]["placement"][1] == "node-1", cluster
    for rank, env in enumerate(again):
        assert env["GROUP_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_PORT"] == str(master_port + 1)
        assert env["resumed_at"] >= 3, env

    def swaps_ended() -> list[dict[str, Any]] | None:
        # The swap's workers start before the action is recorded as ended (seen in CI:
        # read as "running" between the two).
        swaps = [a for a in hosts.actions() if a["type"] == "hot_swap"]
        ended = all(a["status"] in ("succeeded", "failed") for a in swaps)
        return swaps if swaps and ended else None

    swaps = wait_for("the hot swap to end", swaps_ended)
    assert [(a["node"], a["status"]) for a in swaps] == [("node-0", "succeeded")], swaps
    unused = ({"node-2", "node-3"} - {spare}).pop()
    for node in ("node-1", spare, unused):
        wait_for(f"{node}'s host monitor to exit", ended(hosts.procs[node]), within=120)
        assert hosts.procs[node].returncode == 0, hosts.logs()
    assert "finished without this spare" in hosts.log(unused)
    assert all(
        json.loads((hosts.out / f"state-{rank}.json").read_text())["step"] == 120
        for rank in range(2)
    )


def sbatch_example(doc: Path) -> str:
    text = doc.read_text()
    start = text.index("```bash\n#!/bin/bash\n#SBATCH")
    return text[start + len("```bash\n") : text.index("```", start + 10)]


def test_the_sbatch_example_uses_only_flags_and_settings_that_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = sbatch_example(ROOT / "README.md")
    assert sbatch_example(ROOT / "docs" / "local-mode.md") == script
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    for word in words:
        name = word.split("=", 1)[0]
        if name.startswith("SUPERVISOR_") and "=" in word:
            assert name.removeprefix("SUPERVISOR_").lower() in Settings.model_fields, word
        if name.startswith("HOST_MONITOR_") and "=" in word:
            field = name.removeprefix("HOST_MONITOR_").lower()
            assert field in HostMonitorSettings.model_fields, word
    serve = words[words.index("serve") - 1 : words.index("&")]
    assert serve[0] == "supervisor"
    supervisor_cli._parser().parse_args(serve[1:])
    srun = words.index("srun")
    assert words[srun + 1] == "--ntasks-per-node=1" and words[srun + 2] == "host-monitor"
    host_monitor = words[srun + 3 : words.index("code=$?")]
    parser = host_monitor_cli._parser()
    add_arguments(parser)
    args = vars(parser.parse_args(host_monitor))
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    launch = launch_of(args)
    assert launch is not None
    assert (launch.nnodes, launch.node_rank, launch.nproc_per_node) == (2, 1, 8)
    assert launch.command == [sys.executable, "-u", str(tmp_path / "train.py"), "--lr", "3e-4"]
    args.update(launch_defaults(args, {}))
    settings = load_settings(**{**args, "agent_token": "a" * 24})
    assert (settings.job, settings.initial_state, settings.host) == ("train", "running", "0.0.0.0")
