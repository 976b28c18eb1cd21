"""Capped exponential backoff: the one rule every retry loop waits by, the supervisor's,
the host monitor's and the training side's alike (hence here, in the neutral package).

`Backoff` is for a loop that retries until it succeeds (first wait, then twice as long,
up to a cap; `reset` after a success); `attempt_delay` for a numbered attempt (the n-th
retry of an action or a delivery), optionally with "equal jitter" (half fixed, half
random) so that many clients recovering together are not in step.
"""

from __future__ import annotations

from collections.abc import Callable


class Backoff:
    """Waits `first_s`, then `factor` times longer each time, never above `cap_s`."""

    def __init__(self, first_s: float, cap_s: float, factor: float = 2.0) -> None:
        if not 0 < first_s <= cap_s or factor < 1:
            raise ValueError(
                f"backoff: need 0 < first_s <= cap_s and factor >= 1, got "
                f"{first_s}, {cap_s}, {factor}"
            )
        self.first_s = first_s
        self.cap_s = cap_s
        self.factor = factor
        self._next = first_s

    @property
    def fresh(self) -> bool:
        """No wait taken since the start or the last reset (the first failure)."""
        return self._next == self.first_s

    def peek(self) -> float:
        """The next wait, without taking it."""
        return self._next

    def next(self) -> float:
        """The next wait; the one after is longer (up to the cap)."""
        wait = self._next
        self._next = min(self._next * self.factor, self.cap_s)
        return wait

    def reset(self) -> None:
        self._next = self.first_s


def attempt_delay(
    base_s: float,
    attempt: int,
    cap_s: float = float("inf"),
    *,
    jitter: Callable[[], float] | None = None,
) -> float:
    """The wait before retry `attempt` (1: the first retry): `base_s` doubled per attempt,
    capped; with `jitter` (a draw in [0, 1), e.g. `random.random`), between half and all
    of it."""
    # The exponent is bounded: a loop failing for days must not overflow a float.
    ceiling = min(base_s * 2.0 ** min(max(attempt - 1, 0), 64), cap_s)
    if jitter is None:
        return ceiling
    return ceiling * (0.5 + 0.5 * jitter())


__all__ = ["Backoff", "attempt_delay"]
