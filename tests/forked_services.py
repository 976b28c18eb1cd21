"""The supervisors and host monitors that tests start themselves, forked by a warm standby
that imported them once.

Each is a real process of its own, running `python -m supervisor.cli serve ...` (or the
acting stand-in, or `python -m host_monitor.cli ...`) as a test would start it, in its
own session, with the environment and the output file it is given; but forked by the
product's warm standby (training/warm_start.py; tests/forked_ranks.py keeps one per pytest
process and preload), rather than started as a new interpreter that imports FastAPI,
SQLAlchemy, pydantic and the service's models again: about 1.5 s of CPU per supervisor and
0.5 s per host monitor on CI's 2-core machine, most of a short test's cost. What the tests
check of them (their HTTP APIs, what they do on a signal, their exit codes, their logs)
does not depend on how the interpreter started. The local clusters of the tests
(supervisor/local/demo.py) take theirs from `start_local_process`. The commands' own tests
(`supervisor` and `host-monitor` as installed, their start-up errors), `supervisor run`
and `supervisor demo` start new interpreters. A local cluster's service behind a network
namespace's prefix (`ip netns exec NS`) is forked too, and joins that namespace itself
(tests/netns_entry.py).

A forked service is the standby's child: it is not sent SIGTERM when the test's process
dies (a started one is), so a test stops what it started, as every fixture here does.

Only the command's own module runs in the fork: it is left out of the preload, as
`python -m` would find it not yet imported.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from resiliency_protocol.standby_orders import WorkerOrder
from supervisor.local.processes import LocalProcess, start_process
from tests.forked_ranks import ROOT, RankProcess, fork

#: What `supervisor serve` imports, but its command module.
SUPERVISOR_PRELOAD = (
    "uvicorn",
    "policies.default",
    "supervisor.api.app",
    "supervisor.api.uvicorn_server",
    "supervisor.config",
    "supervisor.controller",
    "supervisor.goodput.cli",
    "supervisor.ops.commands",
    "supervisor.run_cli",
    "supervisor.simulate.cli",
)
#: What `host_monitor.cli` imports, but itself: a standby of its own, so that a host
#: monitor holds none of the supervisor's modules (a process's memory is what the tests
#: of its limits measure).
HOST_MONITOR_PRELOAD = (
    "uvicorn",
    "host_monitor.agent",
    "host_monitor.config",
    "host_monitor.server",
)


def start_service(
    module: str,
    args: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    namespace: str | None = None,
) -> RankProcess:
    """`python -m module *args` in the checkout with `env` (replacing the environment), its
    output (stdout and stderr) appended to `log_path`; in the network namespace
    `namespace` (`ip netns add`'s) when one is given (tests/netns_entry.py)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.touch()  # there to be read at once: the child opens it only once forked
    program = ("-m", module, *args)
    if namespace is not None:
        program = ("-m", NETNS_ENTRY, namespace, module, *args)
    order = WorkerOrder(program, dict(env), str(ROOT), str(log_path))
    preload = HOST_MONITOR_PRELOAD if module.startswith("host_monitor.") else SUPERVISOR_PRELOAD
    return RankProcess(fork(order, preload), log_path)


#: The command modules a local cluster starts that `start_local_process` forks.
SERVICES = ("host_monitor.cli", "supervisor.cli")
#: What a forked service runs to join a network namespace first.
NETNS_ENTRY = "tests.netns_entry"
#: The prefix a test's host of network namespaces gives its commands (tests/netns.py).
NETNS_EXEC = ["ip", "netns", "exec"]


def start_local_process(
    args: Sequence[str], env: Mapping[str, str], log_path: Path
) -> LocalProcess:
    """A local cluster's process (supervisor/local/processes.py): its host monitors and
    its supervisor forked, in the network namespace their prefix names if one does (a
    started one imported the service for 25 s on a loaded machine while the job trained
    to its end); anything else started."""
    argv, namespace = list(args), None
    if argv[:3] == NETNS_EXEC and len(argv) > 4:
        namespace, argv = argv[3], argv[4:]
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in SERVICES:
        return start_service(argv[2], argv[3:], env, log_path, namespace)
    return start_process(args, env, log_path)
