"""The sensor's marks of injected faults: muted nodes and the faults failures are due to."""

from __future__ import annotations

from supervisor.sensor.fault_marks import FaultMarks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_mute_lasts_its_duration_or_until_its_fault_ends() -> None:
    clock = Clock()
    marks = FaultMarks(clock)
    marks.mute("n1", 1, duration_s=5.0)
    marks.mute("n2", 2, duration_s=None)
    assert marks.is_muted("n1") and marks.is_muted("n2") and not marks.is_muted("n3")
    clock.now += 5.0
    assert not marks.is_muted("n1") and "n1" not in marks.muted  # lifted by itself
    marks.end(1)  # over already: nothing to do
    marks.end(3)  # another fault: no effect
    assert marks.is_muted("n2")
    marks.end(2)
    assert not marks.is_muted("n2")
    # The losses they caused, and the recoveries from them, are still theirs.
    assert (marks.loss_cause("n1"), marks.loss_cause("n2")) == (1, 2)
    assert marks.recovered("n2") == 2
    assert marks.loss_cause("n2") is None and marks.recovered("n2") is None


def test_an_expected_fault_claims_the_failures_of_its_window() -> None:
    clock = Clock()
    marks = FaultMarks(clock)
    marks.expect("n1", 7, within_s=10.0)
    assert marks.attributed("n1") == 7 and marks.attributed("n2") is None
    assert marks.loss_cause("n1") == 7
    clock.now += 10.0
    assert marks.attributed("n1") == 7  # the window includes its end
    clock.now += 0.001
    assert marks.attributed("n1") is None
    assert marks.loss_cause("n1") == 7  # a loss is its doing until the node recovers


def test_a_withdrawn_fault_claims_nothing() -> None:
    marks = FaultMarks(Clock())
    marks.expect("n1", 7, within_s=60.0)
    marks.expect("n2", 8, within_s=60.0)
    marks.withdraw(7)
    assert (marks.attributed("n1"), marks.loss_cause("n1")) == (None, None)
    assert (marks.attributed("n2"), marks.loss_cause("n2")) == (8, 8)
