"""How long a rank takes to start again on its node: launched anew, or forked by the node's
warm standby (host_monitor/standby.py), which imported torch and the workload once.

One host monitor, no supervisor: the torch workload's rank 0 (a world of one) is started
over the host monitor's API and timed until it has registered with it (`running`: Python
started, torch and the workload imported, the worker client up), then stopped; the two
ways alternate, ROUNDS each, so the machine's load falls on both alike. This is the part
of a restart in place (a crashed rank, the survivors of a full restart) that happens on
the node; detection and the supervisor's decision come on top of it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from bench.table import Row, verdict
from resiliency_protocol.shared_settings import HOST_MONITOR_ENV_PREFIX

ROUNDS = 5
ACTUATOR_TOKEN = "bench-actuator-token"
COMMAND = [sys.executable, "-m", "training.torch_workload"]
PRELOAD = ["training.torch_workload.train"]
WAIT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _host_monitor(tmp: Path) -> Iterator[httpx.Client]:
    argv = [sys.executable, "-m", "host_monitor.cli", "--node", "bench-standby", "--port", "0"]
    argv += ["--run-dir", str(tmp / "run"), "--kernel-log", str(tmp / "kern.log")]
    argv += ["--nvidia-smi", str(tmp / "no-nvidia-smi"), "--shutdown-grace-s", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(HOST_MONITOR_ENV_PREFIX)}
    env["HOST_MONITOR_ACTUATOR_TOKEN"] = ACTUATOR_TOKEN
    with (tmp / "host-monitor.log").open("ab") as log:
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        url = line.rsplit(" ", 1)[-1]
        if not url.startswith("http"):
            raise RuntimeError(f"the host monitor did not start: {line!r}")
        headers = {"Authorization": f"Bearer {ACTUATOR_TOKEN}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            yield api
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        proc.wait(30)


def _workload_env(tmp: Path) -> dict[str, str]:
    return {
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "TOTAL_STEPS": "1000000",
        "STEP_TIME_S": "0.05",
        "D_MODEL": "64",
        "N_LAYERS": "2",
        "SEQ_LEN": "32",
        "S3_CHECKPOINTING_FREQ": "0",
        "IN_MEMORY_CHECKPOINTING_FREQ": "0",
        "OUTPUT_DIR": str(tmp / "out"),
        "OMP_NUM_THREADS": "1",
    }


def _wait(what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not seen within {WAIT_S:.0f} s: {what}")
        time.sleep(0.01)


def _start_once(api: httpx.Client, request_id: str, env: dict[str, str], forked: bool) -> float:
    """Seconds from the start request to the rank registered; the rank stopped after."""
    body: dict[str, object] = {
        "request_id": request_id,
        "job": "bench",
        "command": COMMAND,
        "env": env,
        "workers": [{"rank": 0, "local_rank": 0}],
        **({"standby_preload": PRELOAD} if forked else {}),
    }
    began = time.perf_counter()
    api.post("/v1/workers/start", json=body).raise_for_status()

    def running() -> bool:
        workers = api.get("/v1/status").json()["workers"]
        return any(w["rank"] == 0 and w["state"] == "running" for w in workers)

    _wait(f"rank 0 running ({request_id})", running)
    took = time.perf_counter() - began
    api.post("/v1/workers/stop", json={"grace_s": 10}).raise_for_status()
    return took


def measure(rounds: int = ROUNDS) -> tuple[list[float], list[float]]:
    """(launched, forked) start times, `rounds` each, alternating."""
    launched: list[float] = []
    forked: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-standby-") as name:
        tmp = Path(name)
        env = _workload_env(tmp)
        with _host_monitor(tmp) as api:
            standby = {"job": "bench", "command": COMMAND, "env": env, "preload": PRELOAD}

            def warm() -> bool:
                return bool(api.post("/v1/standby", json=standby).json()["warm"])

            _wait("the standby warm", warm)
            for i in range(rounds):
                launched.append(_start_once(api, f"cold-{i}", env, forked=False))
                forked.append(_start_once(api, f"fork-{i}", env, forked=True))
    return launched, forked


def rows(rounds: int = ROUNDS) -> list[Row]:
    launched, forked = measure(rounds)
    cold, warm = statistics.median(launched), statistics.median(forked)
    return [
        Row(
            f"A rank started again on its node, torch workload (n={rounds}) p50/max",
            f"forked by the warm standby: {warm:.2f} / {max(forked):.2f} s",
            f"launched anew: {cold:.2f} / {max(launched):.2f} s",
            "forked p50 <= half of launched",
            verdict(warm <= cold / 2),
        )
    ]


if __name__ == "__main__":
    from bench.table import render

    print(render(rows()))
