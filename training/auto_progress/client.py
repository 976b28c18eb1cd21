"""The automatic step count's own WorkerClient. Imported by its thread only, at the first
optimizer step: the worker client's imports (httpx) cost nothing to a process that never
steps an optimizer."""

from __future__ import annotations

from training.worker_client import WorkerClient


class CounterClient(WorkerClient):
    """A WorkerClient whose registration and steps are not the script's own: they do not
    make the count step aside (`training.worker_client.script_client_seen`)."""

    reports_for_script = False

    def finishing(self) -> None:
        """Not from `close()`: when the count steps aside for the script's own client, the
        worker goes on training. Said at the interpreter's exit only (`exiting`)."""

    def exiting(self) -> None:
        """The interpreter is exiting: the worker left its loop (see WorkerClient.finishing)."""
        super().finishing()
