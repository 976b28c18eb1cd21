"""The fleet bench's relayed rows (bench/fleet.py, `batch`) on a small fleet, with real
processes: the supervisor answers every beat of a batch without an error or a loss, in
fewer requests than beats, while the bare app gets each beat as a request of its own, or
the same batches (at a fleet's rate, more beats a second than one client sends alone)."""

from __future__ import annotations

from bench.fleet import Group, Phase, run_group
from tests.timing import scaled

PERIOD_S = 0.5


def fleet_phase(bare_batched: bool = False) -> Phase:
    """40 nodes of 2 workers every 0.5 s (about 80 beats a second), late by up to 0.2 s,
    in batches of 16. Lost after 6 s of silence (scaled), not the default 3 periods:
    beside the heavy modules the load generator itself was held up past 1.5 s and every
    node was lost once (its events and actions the statements of a window that should
    have none); these tests measure batching, not loss detection."""
    timeout_periods = scaled(6.0) / PERIOD_S
    return Phase(40, 0.2, PERIOD_S, 16, bare_batched, timeout_periods)


def test_a_small_fleet_beats_through_batches_without_errors() -> None:
    group = Group("sqlite", 2, 4, (fleet_phase(),))
    (window,) = run_group(group, duration_s=2.0, settle_s=1.0)
    assert window.errors == 0
    expected = 40 / PERIOD_S * window.seconds
    for answered in (window.heartbeats, window.bare_heartbeats):
        assert 0.5 * expected <= answered <= 1.5 * expected
    assert window.requests * 8 <= window.heartbeats  # batches, most of them full
    assert window.bare_requests == window.bare_heartbeats  # the bare app: one a beat
    # No node was lost (a loss is an event: a write), and beats write nothing.
    assert window.statements <= 2 * window.seconds


def test_at_a_fleets_rate_the_bare_app_is_sent_the_same_batches() -> None:
    group = Group("sqlite", 2, 4, (fleet_phase(bare_batched=True),))
    (window,) = run_group(group, duration_s=2.0, settle_s=1.0)
    assert window.errors == 0
    expected = 40 / PERIOD_S * window.seconds
    for answered, requests in (
        (window.heartbeats, window.requests),
        (window.bare_heartbeats, window.bare_requests),
    ):
        assert 0.5 * expected <= answered <= 1.5 * expected
        assert requests * 8 <= answered  # batches, most of them full
