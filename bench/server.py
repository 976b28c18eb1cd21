"""Server process of the ingest benchmark: the real app or a bare ASGI app under uvicorn.

Run as `python -m bench.server --app supervisor|bare ...`. Binds 127.0.0.1 on a free
port, prints the port on stdout, serves until SIGTERM. With `--profile PATH` the whole
serve loop runs under cProfile and the stats are dumped to PATH on exit.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def bare_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ceiling: read the whole body, answer 204. No framework, no parsing."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    assert scope["type"] == "http"
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def supervisor_app(
    database_url: str, agent_token: str, operator_token: str, fleet: dict[str, float] | None
) -> Any:
    """The real app. By default with timers out of the way (see below); with `fleet`
    (`period_s`, `timeout_s`), as a fleet's supervisor runs: those heartbeat settings and
    every other setting at its default."""
    from supervisor.api.app import create_app
    from supervisor.config import Settings

    if fleet is not None:
        return create_app(
            Settings(
                database_url=database_url,
                agent_token=agent_token,
                operator_token=operator_token,
                heartbeat_polling_period_s=fleet["period_s"],
                heartbeat_timeout_s=fleet["timeout_s"],
            )
        )
    settings = Settings(
        database_url=database_url,
        agent_token=agent_token,
        operator_token=operator_token,
        heartbeat_timeout_s=600,
        heartbeat_polling_period_s=300,
        # Its periodic row (one per job per period) is not per heartbeat, but would hide
        # one in the benchmark's check that the database does not change.
        goodput_sample_period_s=3600,
    )
    return create_app(settings)


def count_sql() -> None:
    """Count the SQL statements this process sends (SQLAlchemy's cursor events, on every
    engine: one per execute or executemany) and print the counts on stdout at each
    SIGUSR1: `OTHERS PRUNER`, the history pruner's apart: those of its pass, and the job
    scheduler's reads of its job store when it wakes, for the pruner (the scheduler's only
    job here). Its first pass comes a minute after the start, then every
    `history_prune_period_s` (supervisor/pruner.py): a window that caught it would show a
    pass's statements as the steady rate. Outside the app, so that the requests measured
    pass through nothing more."""
    from contextvars import ContextVar

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from supervisor.pruner import HistoryPruner
    from supervisor.schedules.scheduler import JOBS_TABLE

    pruning: ContextVar[bool] = ContextVar("pruning", default=False)
    sent = [0, 0]  # others', the pruner's

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent[pruning.get() or JOBS_TABLE in statement] += 1

    run_pass = HistoryPruner.run_pass

    async def counted_pass(pruner: HistoryPruner) -> None:
        # Its statements run in threads (asyncio.to_thread), which copy this context.
        token = pruning.set(True)
        try:
            await run_pass(pruner)
        finally:
            pruning.reset(token)

    HistoryPruner.run_pass = counted_pass  # type: ignore[method-assign,assignment]
    event.listen(Engine, "before_cursor_execute", count)
    signal.signal(signal.SIGUSR1, lambda *_: print(*sent, flush=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.server")
    parser.add_argument("--app", choices=("supervisor", "bare"), required=True)
    parser.add_argument("--database-url", default="")
    parser.add_argument("--agent-token", default="bench-agent-token")
    parser.add_argument("--operator-token", default="bench-operator-token")
    parser.add_argument("--profile", default=None, help="dump cProfile stats here on exit")
    parser.add_argument(
        "--fleet", default=None, help='JSON {"period_s", "timeout_s"}: default timers else'
    )
    parser.add_argument(
        "--count-sql",
        action="store_true",
        help="print the SQL statements sent at SIGUSR1 (others', the history pruner's)",
    )
    args = parser.parse_args(argv)

    app: Any = bare_app
    if args.app == "supervisor":
        fleet = json.loads(args.fleet) if args.fleet else None
        app = supervisor_app(args.database_url, args.agent_token, args.operator_token, fleet)
    if args.count_sql:
        count_sql()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    print(sock.getsockname()[1], flush=True)
    # uvicorn re-raises the signal that stopped it; make that a no-op so we exit cleanly.
    signal.signal(signal.SIGTERM, lambda *_: None)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    try:
        server.run(sockets=[sock])
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    sys.exit(0)


if __name__ == "__main__":
    main()
