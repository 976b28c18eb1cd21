"""The one backoff rule of the supervisor's retry loops."""

from __future__ import annotations

import pytest

from resiliency_protocol.backoff import Backoff, attempt_delay


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_reset() -> None:
    backoff = Backoff(0.1, 0.5)
    assert backoff.fresh and backoff.peek() == 0.1
    assert [backoff.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert not backoff.fresh
    backoff.reset()
    assert backoff.fresh and backoff.next() == 0.1


def test_attempt_delay_doubles_per_attempt_with_optional_equal_jitter() -> None:
    assert [attempt_delay(1.0, n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert attempt_delay(1.0, 10, cap_s=30.0) == 30.0
    assert attempt_delay(2.0, 2, jitter=lambda: 0.0) == 2.0  # half of 4
    assert attempt_delay(2.0, 2, jitter=lambda: 0.999) == pytest.approx(3.998)


def test_a_backoff_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="first_s <= cap_s"):
        Backoff(1.0, 0.5)
    with pytest.raises(ValueError, match="factor"):
        Backoff(0.1, 1.0, factor=0.5)
