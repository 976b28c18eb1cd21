"""A virtual clock for asyncio: the supervisor's own code runs on it, without sleeping.

`VirtualClockLoop` is an ordinary selector event loop whose `time()` is virtual. When
nothing is ready to run, instead of waiting in `select()` for the next timer, the clock
jumps to that timer. Work sent to a thread (`asyncio.to_thread`, `run_in_executor`) runs
inline, at once: a thread's work would take real time the virtual clock does not see,
and inline it keeps a run deterministic. So `asyncio.sleep`, `asyncio.timeout`,
`loop.call_at` and the store's calls behave as in production, and a month passes in
seconds. The Unix time the code reads (`supervisor.domain.utcnow`) follows the loop.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

from supervisor.domain import wall_clock
from supervisor.errors import SupervisorError

T = TypeVar("T")


class SimulationStalled(SupervisorError, RuntimeError):
    """Nothing is scheduled and nothing is ready: the simulated system waits forever."""


class _JumpingSelector(selectors.BaseSelector):
    """A selector that polls the real one and, instead of blocking, advances the clock."""

    def __init__(self, advance: Callable[[float], None]) -> None:
        self._real = selectors.DefaultSelector()
        self._advance = advance

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationStalled("no timer is scheduled and nothing is ready to run")
        self._advance(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at `start` (loop time 0 is Unix `epoch`)."""

    def __init__(self, epoch: float) -> None:
        self._now = 0.0
        self.epoch = epoch
        super().__init__(_JumpingSelector(self._advance))

    def _advance(self, seconds: float) -> None:
        self._now += seconds

    def time(self) -> float:
        return self._now

    def wall_time(self) -> float:
        """Unix time on the virtual clock."""
        return self.epoch + self._now

    def run_in_executor(  # type: ignore[override]
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future: asyncio.Future[T] = self.create_future()
        try:
            future.set_result(func(*args))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            future.set_exception(exc)
        return future


def run_virtual(main: Coroutine[Any, Any, T], *, epoch: float) -> T:
    """Run `main` to its end on a fresh virtual-clock loop whose Unix time starts at
    `epoch`; `supervisor.domain.utcnow` reads that clock meanwhile."""
    loop = VirtualClockLoop(epoch)
    try:
        with wall_clock(loop.wall_time):
            return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
