"""`supervisor` command line: serve the API, run the demo, print a node's credential, or
operate a running supervisor (get, describe, inject, cordon, watch, completion, ...:
supervisor.ops)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from supervisor.errors import SupervisorError
from supervisor.ops import commands as ops_commands

if TYPE_CHECKING:
    # Every other part is imported where it runs: an operator command (`get`, `describe`,
    # ...) then starts without the service's settings, the demo, the simulator or the
    # server, well under half a second sooner on a loaded machine.
    from resiliency_protocol.logs import LogFormat
    from supervisor.api.app import SupervisorApp
    from supervisor.config import Settings
    from supervisor.config_parts import TlsSettings
    from supervisor.local.demo import LocalDemo
    from supervisor.local.demo_options import DemoOptions
    from supervisor.policy import Policy

log = logging.getLogger("supervisor")

#: The operator commands, parsed by a parser of their own. `completion` describes every
#: command, so it takes the whole one.
OPERATOR_COMMANDS = ops_commands.COMMANDS - {"completion"}


class _Misused(SupervisorError):
    """The operator parser refused the command line: the whole parser says why."""


class _OperatorParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Misused(message)


def _operator_args(argv: list[str]) -> argparse.Namespace | None:
    """`argv` parsed by the operator commands' parser alone; None when it is refused (the
    whole parser then reports it, with the usage of every command)."""
    parser = _OperatorParser(prog="supervisor", description=__doc__)
    ops_commands.add_commands(parser.add_subparsers(dest="command", required=True))
    try:
        return parser.parse_args(argv)
    except _Misused:
        return None


def _parser() -> argparse.ArgumentParser:
    from supervisor import run_cli
    from supervisor.goodput import cli as goodput_cli
    from supervisor.local.demo_options import WORKLOADS, DemoOptions
    from supervisor.simulate import cli as simulate_cli

    parser = argparse.ArgumentParser(prog="supervisor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Run the supervisor service.")
    serve.add_argument("--config", help="YAML settings file (env SUPERVISOR_CONFIG_FILE).")
    serve.add_argument("--host", help="Address to bind (setting `host`).")
    serve.add_argument("--port", type=int, help="Port to bind (setting `port`).")
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="text, or one JSON object per line for a log pipeline (setting `log_format`).",
    )
    credential = sub.add_parser(
        "node-credential",
        help="Print the credential of a node's host monitor (HOST_MONITOR_NODE_CREDENTIAL), "
        "derived from the setting node_key.",
    )
    credential.add_argument("node", help="The node's name, as its heartbeats give it.")
    credential.add_argument("--config", help="YAML settings file (env SUPERVISOR_CONFIG_FILE).")
    demo = sub.add_parser(
        "demo", help="Run a local cluster: host monitors, a training job and the supervisor."
    )
    d = DemoOptions()
    demo.add_argument("--port", type=int, default=d.port, help="Supervisor port.")
    demo.add_argument(
        "--run-dir",
        type=Path,
        default=d.run_dir,
        help=f"Default {d.run_dir}. Created and marked as a run folder; a previous run's is "
        "emptied at start, any other folder that is not empty is refused.",
    )
    demo.add_argument("--replicas", type=int, default=d.replicas, help="Data-parallel replicas.")
    demo.add_argument(
        "--nodes-per-dp",
        type=int,
        help=f"Nodes per replica (default: {d.nodes_per_dp} for numpy, 1 for torch).",
    )
    demo.add_argument("--spares", type=int, default=d.spares, help="Spare nodes.")
    demo.add_argument("--steps", type=int, default=d.total_steps, help="Training steps.")
    demo.add_argument(
        "--step-time-s",
        type=float,
        help=f"Extra seconds per step (default: {d.step_time_s} for numpy, 0 for torch).",
    )
    demo.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=d.workload,
        help="numpy: the sharded NumPy model; torch: a transformer LM, DDP on gloo "
        "(needs the `torch` extra).",
    )
    demo.add_argument(
        "--parallelism",
        choices=("ddp", "fsdp", "hsdp"),
        default=d.parallelism,
        help="torch: ddp (every node holds the model), fsdp (FSDP2: sharded over every "
        "node), hsdp (FSDP2 on 2 replica groups x the rest of the nodes).",
    )
    demo.add_argument("--seed", type=int, default=d.seed)
    demo.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=d.heartbeat_timeout_s,
        help=f"Default {d.heartbeat_timeout_s:g}: faster than a cluster's 15 s, to watch.",
    )
    demo.add_argument("--node-repair-s", type=float, default=d.node_repair_s)
    demo.add_argument(
        "--policy",
        default=d.policy,
        help="The supervisor's policy: 'module:Class' or 'path/to/file.py:Class'.",
    )
    demo.add_argument(
        "--set",
        metavar="SETTING=VALUE",
        action="append",
        default=[],
        help="Any other supervisor setting (e.g. --set restart_window_s=600); repeatable.",
    )
    run_cli.add_commands(sub)
    goodput_cli.add_commands(sub)
    ops_commands.add_commands(sub)
    simulate_cli.add_commands(sub)
    return parser


def _configure_logging(level: str, fmt: LogFormat = "text") -> None:
    from resiliency_protocol.logs import configure_logging

    configure_logging(level, fmt, fixed={"role": "supervisor"})


def _settings(args: argparse.Namespace) -> Settings:
    from supervisor.config import load_settings

    flags = (("host", args.host), ("port", args.port), ("log_format", args.log_format))
    overrides = {k: v for k, v in flags if v is not None}
    return load_settings(args.config, **overrides)


def _node_credential(args: argparse.Namespace) -> None:
    """One line, the credential only: `$(supervisor node-credential n1)` is the value."""
    from supervisor.config import load_settings
    from supervisor.identity.node_keys import node_credential

    settings = load_settings(args.config)
    if settings.node_key is None:
        raise SystemExit(
            "supervisor node-credential: node_key is not set (SUPERVISOR_NODE_KEY or the "
            "settings file)"
        )
    try:
        print(node_credential(settings.node_key.get_secret_value(), args.node))
    except ValueError as exc:
        raise SystemExit(f"supervisor node-credential: {exc}") from None


def _serve(settings: Settings) -> None:
    import uvicorn

    from resiliency_protocol.shared_settings import SERVER_KEEP_ALIVE_S
    from supervisor.api.app import with_tokens
    from supervisor.api.uvicorn_server import StreamEndingServer
    from supervisor.controller import PolicyLoadError, load_policy

    _configure_logging(settings.log_level, settings.log_format)
    try:
        policy = load_policy(settings.policy)
    except PolicyLoadError as exc:
        raise SystemExit(f"supervisor: {exc}") from None
    _check_tls(settings.tls)
    settings = with_tokens(settings)
    app = _app(settings, policy)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # ours (_configure_logging): uvicorn's lines in the same format
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        # Both or neither (checked by the settings): HTTPS with them, HTTP without.
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
    )
    StreamEndingServer(config, app.state.supervisor.hub).run()


def _check_tls(settings: TlsSettings) -> None:
    """The TLS files, read now: one line naming the setting, not a traceback later."""
    from resiliency_protocol.tls import TLSError, server_context
    from supervisor.config import ConfigError

    try:
        if settings.tls_cert_file is not None and settings.tls_key_file is not None:
            server_context(
                settings.tls_cert_file,
                settings.tls_key_file,
                cert_name="tls_cert_file",
                key_name="tls_key_file",
            )
        settings.host_monitor_ssl_context()
    except TLSError as exc:
        raise ConfigError(str(exc)) from None


def _app(settings: Settings, policy: Policy) -> SupervisorApp:
    """The app; a Kubernetes configuration that cannot be loaded is one line, no traceback."""
    from supervisor.api.app import create_app
    from supervisor.runtime import Supervisor

    kube_backend = settings.backend == "kubernetes" and not settings.dry_run
    kube_identity = "kubernetes" in settings.agent_auth
    if not (kube_backend or settings.leader_election or kube_identity):
        return create_app(settings, Supervisor(settings, policy=policy))
    from supervisor.kube.errors import KubeConfigError  # the kubernetes client is heavy

    try:
        supervisor = Supervisor(settings, policy=policy)
    except KubeConfigError as exc:
        raise SystemExit(f"supervisor: kubernetes backend: {exc}") from None
    try:
        return create_app(settings, supervisor)
    except KubeConfigError as exc:
        what = "leader election" if settings.leader_election else "agent_auth kubernetes"
        raise SystemExit(f"supervisor: {what}: {exc}") from None


def _demo_options(args: argparse.Namespace, nodes_per_dp: int, step_time_s: float) -> DemoOptions:
    from supervisor import run_cli
    from supervisor.local.demo_options import DemoOptions

    return DemoOptions(
        run_dir=args.run_dir,
        port=args.port,
        replicas=args.replicas,
        nodes_per_dp=nodes_per_dp,
        spares=args.spares,
        total_steps=args.steps,
        step_time_s=step_time_s,
        seed=args.seed,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        heartbeat_polling_period_s=min(1.0, args.heartbeat_timeout_s / 4),
        node_repair_s=args.node_repair_s,
        workload=args.workload,
        parallelism=args.parallelism,
        policy=args.policy,
        supervisor_env=run_cli.settings_env("demo", args.set),
    )


def _demo(args: argparse.Namespace) -> None:
    torch = args.workload == "torch"
    if torch and importlib.util.find_spec("torch") is None:
        raise SystemExit(
            "supervisor demo: --workload torch needs PyTorch: "
            "pip install 'resiliency-supervisor[torch]'"
        )
    if not torch and importlib.util.find_spec("numpy") is None:
        raise SystemExit(
            "supervisor demo: --workload numpy needs NumPy: "
            "pip install 'resiliency-supervisor[demo]'"
        )
    from supervisor.local import run_folder
    from supervisor.local.demo_options import DemoOptions

    defaults = DemoOptions()
    nodes_per_dp = args.nodes_per_dp or (1 if torch else defaults.nodes_per_dp)
    step_time_s = args.step_time_s
    if step_time_s is None:
        step_time_s = 0.0 if torch else defaults.step_time_s
    try:
        options = _demo_options(args, nodes_per_dp, step_time_s)
    except ValueError as exc:
        raise SystemExit(f"supervisor demo: --{str(exc).replace('_', '-')}") from None
    from supervisor.controller import PolicyLoadError, load_policy
    from supervisor.local.demo import LocalDemo

    try:
        load_policy(options.policy)  # here, before any process starts
    except PolicyLoadError as exc:
        raise SystemExit(f"supervisor demo: --policy: {exc}") from None
    try:
        run_folder.check(options.run_dir.resolve())  # before the first line, as the others
    except run_folder.RunFolderError as exc:
        raise SystemExit(f"supervisor demo: --run-dir {exc}") from None
    demo = LocalDemo(options)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        print(f"starting {len(options.nodes)} nodes, a training job and the supervisor ...")
        print(f"  {_settings_line(options)}", flush=True)
        try:
            demo.start()
        except run_folder.RunFolderError as exc:  # taken since the check
            raise SystemExit(f"supervisor demo: --run-dir {exc}") from None
        except RuntimeError as exc:  # a part that did not come up: which, and its log
            raise SystemExit(f"supervisor demo: {exc}") from None
        _print_banner(demo)
        last, printed = "", 0.0
        while not stopping:
            time.sleep(1.0)
            for node in demo.repair_nodes():
                print(f"  {node} repaired: its host monitor is back, as a spare", flush=True)
            exited = demo.supervisor.poll() if demo.supervisor is not None else None
            if exited is not None:
                # As its Deployment would: started again, while the job keeps training.
                print(f"  the supervisor exited ({exited}); starting it again ...", flush=True)
                try:
                    pid = demo.restart_supervisor()
                except RuntimeError as exc:  # it does not come up: stop, saying where to look
                    print(f"the supervisor did not start again: {exc}", flush=True)
                    break
                print(f"  the supervisor is back (pid {pid})", flush=True)
                continue
            step, news = _status(demo)
            # A line when something happened, else one every 10 s to show progress.
            if news != last or time.monotonic() - printed >= 10:
                print(f"  step {step}  {news}", flush=True)
                last, printed = news, time.monotonic()
    finally:
        # Stop first: printing can fail (a closed terminal or pipe) and must not leave
        # the cluster running.
        demo.stop()
        with contextlib.suppress(OSError):
            print("stopped every process of the demo", flush=True)


def _settings_line(options: DemoOptions) -> str:
    extra = "".join(
        f" {k.removeprefix('SUPERVISOR_').lower()}={v}" for k, v in options.supervisor_env.items()
    )
    return (
        f"demo settings: heartbeat_timeout_s={options.heartbeat_timeout_s:g} (a cluster's "
        f"default: 15), heartbeat_polling_period_s={options.heartbeat_polling_period_s:g}, "
        f"in_memory_checkpointing_freq={options.in_memory_checkpointing_freq}, "
        f"s3_checkpointing_freq={options.s3_checkpointing_freq}, "
        f"node_repair_s={options.node_repair_s:g}, policy={options.policy}{extra}"
    )


def _status(demo: LocalDemo) -> tuple[str, str]:
    """(training step, what the cluster and the supervisor are doing)."""
    try:
        job = demo.api(f"/api/v1/jobs/{demo.options.job}")
        nodes = demo.api("/api/v1/nodes")
        events = demo.api("/api/v1/events", limit=1)["items"]
        actions = demo.api("/api/v1/actions", limit=1)["items"]
    except Exception as exc:  # the supervisor may be restarting: say so, keep going
        return "?", f"(supervisor not answering: {type(exc).__name__})"
    alive = sum(1 for n in nodes if n["alive"])
    spares = sum(1 for n in nodes if n["alive"] and n["state"] == "spare" and not n["cordoned"])
    event = f"{events[0]['type']} on {events[0]['node']}" if events else "none"
    action = (
        f"{actions[0]['type']} {actions[0]['status']}"
        + (f" ({actions[0]['node']})" if actions[0]["node"] else "")
        if actions
        else "none"
    )
    return str(job["last_step"]), (
        f"replicas {job['num_dp_replicas']}  nodes alive {alive}/{len(nodes)}  "
        f"spares {spares}  last event: {event}  last action: {action}"
    )


def _print_banner(demo: LocalDemo) -> None:
    url, op = demo.url, demo.operator_token
    auth = f"-H 'Authorization: Bearer {op}'"
    job_node = demo.options.nodes[0]
    pid = demo.supervisor.pid if demo.supervisor is not None else "?"
    print(
        f"""
Local cluster running: {len(demo.options.nodes)} nodes (host monitors), job '{demo.options.job}'
({demo.options.replicas} replicas x {demo.options.nodes_per_dp} nodes) training, and the
supervisor at {url}   (run directory: {demo.run_dir})
  operator token: {op}
  dashboard:      {url}/   (it asks for the operator token)

Kill a node of the job and watch: detection, emergency checkpoint, hot-swap, resume.
  curl -s -X POST {url}/api/v1/faults {auth} -H 'Content-Type: application/json' \\
    -d '{{"kind":"node_down","node":"{job_node}"}}'
Other faults: worker_crash, worker_hang, straggler (slowdown, duration_s), xid (code), ecc (count),
heartbeat_loss, or a schedule: -d '{{"schedule":"random,60"}}'
See what happened:
  curl -s {url}/api/v1/events {auth}
  curl -s {url}/api/v1/actions {auth}
Kill only the supervisor (kill -9 {pid}): the job keeps training; it is started again,
as its Deployment would, and carries on from its database.
API documentation: {url}/docs     Stop with Ctrl+C (every process is stopped).
""",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OPERATOR_COMMANDS:
        quick = _operator_args(argv)
        if quick is not None:
            raise SystemExit(ops_commands.run(quick))
    from supervisor import run_cli
    from supervisor.config import ConfigError
    from supervisor.goodput import cli as goodput_cli
    from supervisor.simulate import cli as simulate_cli

    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            _serve(_settings(args))
        elif args.command == "demo":
            _demo(args)
        elif args.command in run_cli.COMMANDS:
            raise SystemExit(run_cli.run(args))
        elif args.command == "node-credential":
            _node_credential(args)
        elif args.command in simulate_cli.COMMANDS:
            raise SystemExit(simulate_cli.run(args))
        elif args.command in ops_commands.COMMANDS:  # completion
            raise SystemExit(ops_commands.run(args))
        else:
            try:
                code = ops_commands.guarded(args.command, lambda: goodput_cli.run(args))
            except (ValueError, OSError) as exc:  # offline: a bad file or flag
                raise SystemExit(f"supervisor {args.command}: {exc}") from None
            raise SystemExit(code)
    except ConfigError as exc:
        raise SystemExit(f"supervisor: {exc}") from None


if __name__ == "__main__":
    main()
