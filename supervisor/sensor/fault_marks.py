"""The sensor's side of fault injection: which nodes' failures an injected fault explains.

Faults are injected by `supervisor.fault_injection.FaultInjector`; the sensor only has to know two
things about them, kept here by node name:

- **Muted nodes.** A `heartbeat_loss` fault mutes a node: the sensor drops its heartbeats,
  as a lost packet would be, until the fault ends (`end`) or its duration has passed. The
  loss that follows, and the node's recovery, carry the fault's id.
- **Expected failures.** A fault acted out by the backend (a worker crash, a node down)
  is expected on its node for a window: the events the node raises within it (an exit,
  a lost heartbeat, a recovery) carry the fault's id. A fault the node refused is
  withdrawn (`withdraw`): what fails next is not its doing.

Times are the sensor's clock (event-loop time), read through the `clock` given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Mute(NamedTuple):
    fault_id: int
    #: Clock time the mute lifts by itself; None: only when the fault ends.
    until: float | None


class Expectation(NamedTuple):
    fault_id: int
    #: Clock time past which the node's failures are no longer the fault's.
    until: float


class FaultMarks:
    """Which fault mutes a node's heartbeats, and which fault its failures are due to."""

    __slots__ = ("_clock", "_expected", "_loss", "muted")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        #: node -> its mute. Read as is on the sensor's heartbeat fast path (a dict lookup,
        #: no call); changed only through the methods below.
        self.muted: dict[str, Mute] = {}
        self._expected: dict[str, Expectation] = {}
        # node -> the fault its next heartbeat loss (and recovery from it) is due to.
        self._loss: dict[str, int] = {}

    # --- what fault injection tells --------------------------------------------------------

    def mute(self, node: str, fault_id: int, duration_s: float | None) -> None:
        """Drop the node's heartbeats from now on (for `duration_s`, or until `end`), as
        if its network were down."""
        until = None if duration_s is None else self._clock() + duration_s
        self.muted[node] = Mute(fault_id, until)
        self._loss[node] = fault_id

    def expect(self, node: str, fault_id: int, within_s: float) -> None:
        """Attribute the node's next failures (within `within_s`) to this fault."""
        self._expected[node] = Expectation(fault_id, self._clock() + within_s)
        self._loss[node] = fault_id

    def end(self, fault_id: int) -> None:
        """The fault is over: the nodes it muted are heard again. What it caused, their
        recovery included, still carries its id."""
        for node in [n for n, mute in self.muted.items() if mute.fault_id == fault_id]:
            del self.muted[node]

    def withdraw(self, fault_id: int) -> None:
        """The fault never happened (its node refused it): what fails next is not its doing."""
        for node in [n for n, e in self._expected.items() if e.fault_id == fault_id]:
            del self._expected[node]
        for node in [n for n, f in self._loss.items() if f == fault_id]:
            del self._loss[node]

    # --- what the sensor reads ---------------------------------------------------------------

    def is_muted(self, node: str) -> bool:
        """Whether the node's heartbeats are to be dropped now; a mute past its duration
        is lifted."""
        mute = self.muted.get(node)
        if mute is None:
            return False
        if mute.until is None or self._clock() < mute.until:
            return True
        del self.muted[node]
        return False

    def attributed(self, node: str) -> int | None:
        """The fault the node's failure now is due to, if it is within its window."""
        expected = self._expected.get(node)
        if expected is None:
            return None
        if self._clock() <= expected.until:
            return expected.fault_id
        del self._expected[node]
        return None

    def loss_cause(self, node: str) -> int | None:
        """The fault the node's heartbeat loss is due to."""
        return self._loss.get(node)

    def recovered(self, node: str) -> int | None:
        """The node is heard from again after a loss: the fault that caused the loss (its
        recovery carries its id), which causes no further loss."""
        return self._loss.pop(node, None)
