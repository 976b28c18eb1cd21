"""What a worker this agent launches (or a standby of one) starts with: its environment,
its log file and the file its emergency requests come through."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from host_monitor.config import HostMonitorSettings, env_without_secrets
from resiliency_protocol import worker_env
from resiliency_protocol.launch import thread_default
from resiliency_protocol.logs import ENV_LOG_FORMAT, JsonFormatter
from resiliency_protocol.node_commands import StartWorkersRequest

log = logging.getLogger(__name__)

# Env of launched workers naming the file that holds the current emergency request id
# (read by training/worker_client.py after SIGUSR1, which carries no data).
ENV_REQUEST_FILE = worker_env.HOST_MONITOR_REQUEST_FILE
# Env of launched workers naming their job (what a worker pod sets itself on Kubernetes;
# read by training/worker_client.py and sent with its registration).
ENV_JOB = worker_env.HOST_MONITOR_JOB


class WorkerEnvironment:
    """The environment and files of the workers one node launches."""

    def __init__(self, settings: HostMonitorSettings, worker_token: str, base_url: str) -> None:
        self.node = settings.node
        self.run_dir = settings.run_dir
        self.base_url = base_url
        self._worker_token = worker_token
        # How launched workers verify our certificate (HOST_MONITOR_CA_FILE, ...).
        self._tls_env = settings.worker_tls_env()
        # The workers log as their host monitor does (training.logs reads it).
        self._log_env = {ENV_LOG_FORMAT: settings.log_format}

    def of_job(
        self, job: str, env: dict[str, str], ranks: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The agent's own environment (no secrets), the request's `env`, the rank's part
        (`ranks`: RANK, LOCAL_RANK) and what reaches this host monitor, in that order of
        precedence from lowest."""
        return {
            **env_without_secrets(os.environ),
            **env,
            **(ranks or {}),
            "NODE_NAME": self.node,
            worker_env.HOST_MONITOR_URL: self.base_url,
            worker_env.HOST_MONITOR_WORKER_TOKEN: self._worker_token,
            **self._tls_env,
            **self._log_env,
            ENV_JOB: job,
        }

    def of_rank(self, req: StartWorkersRequest, rank: int, local_rank: int) -> dict[str, str]:
        env = self.of_job(
            req.job, req.env, {worker_env.RANK: str(rank), worker_env.LOCAL_RANK: str(local_rank)}
        )
        return thread_default(env, len(req.workers))

    def of_standby(self, req: StartWorkersRequest) -> dict[str, str]:
        """What a standby starts with: a worker's environment without its rank's part (the
        order it takes over with carries all of it)."""
        env = self.of_rank(req, 0, 0)
        for key in (worker_env.RANK, worker_env.LOCAL_RANK):
            env.pop(key, None)
        return env

    def log_path(self, req: StartWorkersRequest, rank: int) -> Path:
        # One file per node, job and rank, appended across restarts (easy to `tail -f`);
        # each start writes a header line so restarts can be told apart.
        path = self.run_dir / f"{self.node}.{req.job}.rank{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._log_env[ENV_LOG_FORMAT] == "json":  # the file is one the pipeline reads
            record = logging.LogRecord(
                log.name,
                logging.INFO,
                __file__,
                0,
                "start %s: %s",
                (req.request_id, req.command),
                None,
            )
            record.role, record.node, record.job, record.rank = (
                "host-monitor",
                self.node,
                req.job,
                rank,
            )
            header = JsonFormatter().format(record)
        else:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            header = f"=== host-monitor: start {req.request_id} at {stamp}: {req.command}"
        with path.open("a") as f:
            f.write(header + "\n")
        return path

    def request_file(self, req: StartWorkersRequest, rank: int) -> Path:
        """Where this worker finds the id of the emergency round it was signalled for."""
        path = self.run_dir / f"{self.node}.{req.job}.rank{rank}.emergency-request"
        path.unlink(missing_ok=True)  # an id left by a previous run must not be acked again
        return path
