"""Forwards the workers' checkpoint reports to the supervisor; nothing acknowledged is lost.

- A report is appended to an outbox file (one JSON line, fsynced) before the worker gets
  its 202, so it survives a crash or a restart of the host monitor; reports left in the
  outbox by a previous run are sent first.
- One task sends them in batches to `POST /api/v1/checkpoints` (with the host monitor's
  credential, host_monitor/credentials.py) and drops
  them from the outbox only once the supervisor answered 200, which it sends after
  committing them. Failures are retried with an exponential backoff with jitter, capped at
  the heartbeat period: a supervisor that is down for hours costs one request per period.
- Each report gets an id when it is received; a batch sent again (the acknowledgement was
  lost) is stored once by the supervisor.
- A batch the supervisor refuses (422: a report it cannot take, which our own checks make
  unlikely; 403: a report of another node than our credential's, left in the outbox by a
  run under another node name) is sent again one report at a time, and only the refused
  report is dropped, with an error line naming it.

Checkpoints are rare (every few minutes per worker), so the outbox is written
synchronously on the event loop: no write can interleave with the rewrite after an ack.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import ssl
import uuid
from collections import deque
from pathlib import Path

import httpx

from host_monitor.credentials import BearerCredential, CredentialError
from resiliency_protocol.backoff import attempt_delay
from resiliency_protocol.checkpoint_reports import (
    SUPERVISOR_PATH,
    CheckpointReport,
    CheckpointReportIn,
)
from resiliency_protocol.clock import utcnow
from resiliency_protocol.error_reading import error_message
from resiliency_protocol.tls import client_context

log = logging.getLogger(__name__)

BATCH = 500  # reports per request (the supervisor takes up to 1000)
MAX_OUTBOX = 100_000  # reports kept while the supervisor is unreachable
PATH = SUPERVISOR_PATH

#: A report as kept in the outbox and sent: a CheckpointReportIn's JSON when this host
#: monitor added it; a line an older one left is sent as it is (the supervisor judges it).
OutboxLine = dict[str, object]


class CheckpointForwarder:
    def __init__(
        self,
        supervisor_url: str,
        credential: str | BearerCredential,
        node: str,
        outbox: Path,
        *,
        max_backoff_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.url = supervisor_url.rstrip("/") + PATH
        # How an https:// supervisor is verified (default: the system's trust store).
        self._ssl = ssl_context if ssl_context is not None else client_context()
        self._credential = BearerCredential.of(credential)
        self.node = node
        self.outbox = outbox
        self.max_backoff_s = max(max_backoff_s, 0.05)
        self._pending: deque[OutboxLine] = deque()
        self._wake = asyncio.Event()
        self._failures = 0
        self._last_problem: str | None = None
        self._one_by_one = False
        self.delivered = 0  # reports acknowledged, for status and tests
        self._load()

    # --- used by the rest of the agent ----------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(
        self,
        report: CheckpointReport,
        *,
        rank: int,
        job: str | None,
        time: str | None = None,
        world: int | None = None,
        key: str | None = None,
    ) -> str:
        """Keep `report`, of worker `rank` (in `world`), (durably) for sending; returns its
        id. Call before acking it. ``time``: when it finished (ISO, with a zone; default
        now); ``key``: the worker's name for it, which makes the id (a report the worker
        sent again, to a host monitor restarted meanwhile, is then still stored once).
        Raises ValueError (pydantic's ValidationError) for a report the supervisor would
        refuse.
        """
        fields: dict[str, object] = {
            "id": f"{self.node}-{key if key is not None else uuid.uuid4().hex}",
            "node": self.node,
            "job": job,
            "rank": rank,
            # Its `bytes`, `total_s` and `error` left out when unknown: a report without
            # them is what a supervisor that predates them accepts, and old outbox lines
            # look the same.
            **report.model_dump(exclude_none=True),
            "time": time if time is not None else utcnow().isoformat(),
        }
        if world is not None:  # the worker's world: an older one's is not recorded
            fields["world"] = world
        line: OutboxLine = CheckpointReportIn.model_validate(fields).model_dump(
            mode="json", exclude_unset=True
        )
        if len(self._pending) >= MAX_OUTBOX:
            dropped = self._pending.popleft()
            log.error("checkpoint outbox full: dropping the oldest report (%s)", dropped["id"])
            self._rewrite()
        self._pending.append(line)
        self._append(line)
        self._wake.set()
        return str(line["id"])

    # --- the task -------------------------------------------------------------------------

    async def run(self) -> None:
        timeout = httpx.Timeout(5.0, connect=1.0)
        async with httpx.AsyncClient(timeout=timeout, verify=self._ssl) as client:
            while True:
                if not self._pending:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if not await self._send(client):
                    # New reports do not cut a backoff short: the supervisor is down.
                    await asyncio.sleep(self._delay())

    def _delay(self) -> float:
        return attempt_delay(0.05, self._failures, self.max_backoff_s, jitter=random.random)

    async def _send(self, client: httpx.AsyncClient) -> bool:
        size = 1 if self._one_by_one else BATCH
        batch = [self._pending[i] for i in range(min(size, len(self._pending)))]
        try:
            headers = {"Authorization": self._credential.header()}
            # When it is sent, by this clock: the supervisor checks the clock on it, and
            # the reports' times against it (they may have waited here for a while).
            # The reports as kept in the outbox (each a CheckpointReportIn when added; a
            # line an older host monitor left is sent as it is: the supervisor judges it).
            body = {"reports": batch, "sent_at": utcnow().isoformat()}
            response = await client.post(self.url, json=body, headers=headers)
        except CredentialError as exc:
            self._failed(str(exc))
            return False
        except httpx.HTTPError as exc:
            self._failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return False
        if response.status_code == 200:
            self._acked(len(batch))
            return True
        detail = error_message(response)
        if response.status_code == 401:
            self._credential.refresh()  # rotated meanwhile: read it again
        if response.status_code in (403, 422):
            if len(batch) > 1:
                self._one_by_one = True  # find the report it refuses
                return True
            log.error("supervisor refused checkpoint report %s, dropped: %s", batch[0], detail)
            self._acked(1)
            return True
        self._failed(f"HTTP {response.status_code}: {detail}")
        return False

    def _acked(self, count: int) -> None:
        for _ in range(count):
            self._pending.popleft()
        self.delivered += count
        if self._failures:  # said before the outbox shrinks: whoever sees it empty sees this
            log.info(
                "checkpoint reports delivered to %s after %d failed attempt(s)",
                self.url,
                self._failures,
            )
        self._rewrite()
        self._failures = 0
        self._last_problem = None
        if not self._pending:
            self._one_by_one = False

    def _failed(self, problem: str) -> None:
        self._failures += 1
        if problem != self._last_problem:  # one line per distinct problem, not per retry
            log.warning(
                "checkpoint reports to %s failed (%s); %d kept, retrying with backoff",
                self.url,
                problem,
                len(self._pending),
            )
            self._last_problem = problem

    # --- the outbox file --------------------------------------------------------------------

    def _load(self) -> None:
        try:
            text = self.outbox.read_text()
        except FileNotFoundError:
            return
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                report = json.loads(line)
            except ValueError:
                # Only a line cut short by a crash mid-write can be bad: it was never acked
                # to its worker.
                log.warning(
                    "checkpoint outbox %s: line %d unreadable, skipped", self.outbox, number
                )
                continue
            if isinstance(report, dict) and isinstance(report.get("id"), str):
                self._pending.append(report)
        if self._pending:
            log.info(
                "checkpoint outbox: %d report(s) from a previous run to send", len(self._pending)
            )

    def _append(self, report: OutboxLine) -> None:
        self.outbox.parent.mkdir(parents=True, exist_ok=True)
        with self.outbox.open("a") as f:
            f.write(json.dumps(report, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _rewrite(self) -> None:
        if not self._pending:
            with self.outbox.open("w") as f:
                os.fsync(f.fileno())
            return
        tmp = self.outbox.with_name(self.outbox.name + ".tmp")
        with tmp.open("w") as f:
            f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in self._pending)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.outbox)
