"""A backend that stands in for one that acts, for tests of what follows an action.

The dry-run backend records what it is asked to do and touches nothing, and the supervisor
running it is a dry run: its actions are marked so and move no node. A test of what an
acting supervisor shows after its actions (a cordoned node, a maintenance window's steps)
uses `RecordingBackend`: it records and touches nothing too, but answers as a backend that
acted, so its actions are carried out as far as the supervisor can tell.

`python -m tests.acting_stand_in serve ...` is `supervisor serve` with it in place of the
dry-run backend (`backend: dry_run` without `dry_run: true`); any other backend, or a dry
run asked for, is left as the settings say.
"""

from __future__ import annotations

from supervisor import cli, runtime
from supervisor.actuator import Backend, DryRunBackend
from supervisor.config import Settings


class RecordingBackend(DryRunBackend):
    dry_run = False


_settings_backend = runtime.make_backend


def make_backend(settings: Settings) -> Backend:
    if settings.backend == "dry_run" and not settings.dry_run:
        return RecordingBackend()
    return _settings_backend(settings)


if __name__ == "__main__":
    runtime.make_backend = make_backend  # read by Supervisor() when none is passed
    cli.main()
