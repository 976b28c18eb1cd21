"""The settings the supervisor, the host monitor and the training side must agree on,
each declared once here: every process's own settings take their default from here, so
that one side's default never drifts from the other's. Imports nothing from supervisor,
host_monitor or training. The worker's environment variables are in worker_env.py.
"""

from __future__ import annotations

from typing import Literal

from resiliency_protocol.logs import LogFormat

#: The prefix of the host monitor's settings in its environment (`HOST_MONITOR_NODE`...):
#: read by the host monitor, written by whatever starts one (the local cluster, the demo).
HOST_MONITOR_ENV_PREFIX = "HOST_MONITOR_"

#: The port of a host monitor's local API: where it binds (`host_daemon_port`) and where
#: the supervisor reaches it when its heartbeat gives no address (`host_monitor_port`).
DEFAULT_HOST_MONITOR_PORT = 9400

#: How often a host monitor sends a heartbeat (`heartbeat_polling_period_s` on both sides:
#: the supervisor derives its waits from it).
DEFAULT_HEARTBEAT_POLLING_PERIOD_S = 5.0

#: How long a server of ours (the supervisor's API, a host monitor's, the heartbeat
#: relay) keeps an idle HTTP connection open, and how long our clients reuse one. The
#: client's is the shorter, so that no request goes out on a connection the server is
#: closing at that moment, which fails it ("Server disconnected without sending a
#: response"): uvicorn's and httpx's defaults are both 5 s, which a heartbeat every 5 s
#: meets head on. A connection reused between heartbeats also spares a TLS handshake.
SERVER_KEEP_ALIVE_S = 75
CLIENT_KEEP_ALIVE_S = 60.0

#: Repeats of the same GPU error within this are dropped (`gpu_report_cooldown_s`: the
#: host monitor does not send them, the supervisor does not act on them).
DEFAULT_GPU_REPORT_COOLDOWN_S = 60.0

#: Seconds a rank trains on after the supervisor last answered its host monitor
#: (`host_lease_s`, worker_env.HOST_LEASE_S): three default heartbeat periods.
DEFAULT_HOST_LEASE_S = 3 * DEFAULT_HEARTBEAT_POLLING_PERIOD_S

#: The tree (a tmpfs) the workers' RAM checkpoints live under: the host monitor's
#: `checkpoint_root` (the only tree it replicates from or fetches into), the training
#: side's RAM tier (`<root>/<job>`), and what the local cluster tells its workers.
DEFAULT_CHECKPOINT_ROOT = "/dev/shm/resiliency-checkpoints"

#: `log_level` and `log_format` of every process (a host monitor gives its format to the
#: workers it launches, logs.ENV_LOG_FORMAT).
LogLevel = Literal["debug", "info", "warning", "error"]
DEFAULT_LOG_LEVEL: LogLevel = "info"
DEFAULT_LOG_FORMAT: LogFormat = "text"


def host_monitor_env(setting: str) -> str:
    """The environment variable of the host monitor's setting `setting`."""
    return HOST_MONITOR_ENV_PREFIX + setting.upper()
