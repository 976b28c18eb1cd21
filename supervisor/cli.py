"""`supervisor` command line: serve the API, or run the demo."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import uvicorn

from supervisor.api.app import create_app, with_tokens
from supervisor.config import ConfigError, Settings, load_settings
from supervisor.controller import PolicyLoadError, load_policy
from supervisor.runtime import Supervisor

log = logging.getLogger("supervisor")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="supervisor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Run the supervisor service.")
    demo = sub.add_parser("demo", help="Run the service locally with demo settings.")
    for p in (serve, demo):
        p.add_argument("--config", help="YAML settings file (env SUPERVISOR_CONFIG_FILE).")
        p.add_argument("--host", help="Address to bind (setting `host`).")
        p.add_argument("--port", type=int, help="Port to bind (setting `port`).")
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _settings(args: argparse.Namespace, **defaults: Any) -> Settings:
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = load_settings(args.config)
    # Demo defaults apply only where the user set nothing.
    explicit = settings.model_fields_set
    demo = {k: v for k, v in defaults.items() if k not in explicit}
    if demo or overrides:
        settings = load_settings(args.config, **{**demo, **overrides})
    return settings


def _serve(settings: Settings, banner: bool = False) -> None:
    _configure_logging(settings.log_level)
    try:
        policy = load_policy(settings.policy)
    except PolicyLoadError as exc:
        raise SystemExit(f"supervisor: {exc}") from None
    settings = with_tokens(settings)
    supervisor = Supervisor(settings, policy=policy)
    app = create_app(settings, supervisor)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    if banner:
        _print_banner(settings)
    server.run()


def _print_banner(settings: Settings) -> None:
    assert settings.agent_token is not None and settings.operator_token is not None
    url = f"http://{settings.host}:{settings.port}"
    op = settings.operator_token.get_secret_value()
    agent = settings.agent_token.get_secret_value()
    beat = (
        '{"node":"n1","state":"running","job":"j1",'
        '"workers":[{"rank":0,"local_rank":0,"pid":123,"state":"running","step":10}]}'
    )
    print(
        f"""
Resiliency supervisor demo listening on {url}  (database: {settings.database_url})
  operator token: {op}
  agent token:    {agent}

Send a heartbeat as node n1 of job j1:
  curl -s -X POST {url}/api/v1/heartbeats -H 'Authorization: Bearer {agent}' \\
    -H 'Content-Type: application/json' \\
    -d '{beat}'
Inject a GPU XID 79 on it and see the events and the actions the policy took:
  curl -s -X POST {url}/api/v1/faults -H 'Authorization: Bearer {op}' \\
    -H 'Content-Type: application/json' -d '{{"kind":"xid","node":"n1","code":79}}'
  curl -s {url}/api/v1/events -H 'Authorization: Bearer {op}'
  curl -s {url}/api/v1/actions -H 'Authorization: Bearer {op}'
API documentation: {url}/docs     Stop with Ctrl+C.
""",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            _serve(_settings(args))
        else:
            settings = _settings(
                args,
                database_url="sqlite:///./var/demo.db",
                enable_fault_injection=True,
                heartbeat_polling_period_s=1.0,
                heartbeat_timeout_s=5.0,
                num_dp_replicas=2,
                min_num_dp_replicas=1,
                max_num_dp_replicas=2,
                num_nodes_per_dp=2,
                enable_workload_scaling=True,
            )
            _serve(settings, banner=True)
    except ConfigError as exc:
        raise SystemExit(f"supervisor: {exc}") from None


if __name__ == "__main__":
    main()
