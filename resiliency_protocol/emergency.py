"""The emergency checkpoint across nodes: the host monitor's bodies for it, the client
that asks every node's host monitor at once, and what came of it.

A worker acks its save to its host monitor (`EmergencyAck`); the supervisor's actuator
asks each host monitor of the job (`POST /v1/emergency-checkpoint`,
`EmergencyCheckpointRequest`), which signals its workers and answers with their acks
(`EmergencyCheckpointResult`). `emergency_checkpoint` does the asking for every backend,
and `EmergencyCheckpoint.succeeded` is the one rule of success:

    An emergency checkpoint succeeded when at least one worker saved, and every node
    asked answered with the result of its round in which no worker it signalled failed
    to save or stayed silent until the deadline.

So a node that cannot be reached, a worker that fails its save, or one that does not ack
in time fails the checkpoint, naming them (`EmergencyCheckpoint.problems`); a worker
that was not running when its node was asked has nothing to save and is not waited for.

Only a worker that said it takes emergency checkpoints (`WorkerRegistration.
emergency_checkpoints`: its SIGUSR1 handler is installed) is signalled: SIGUSR1's default
action would end any other. When no worker was signalled, every node answered, and the
registered ones said they take none, the job takes no emergency checkpoints
(`EmergencyCheckpoint.takes_none`): nothing failed, there is just nothing to take.

Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx
from pydantic import BaseModel, ConfigDict, Field

from resiliency_protocol.error_reading import error_message

#: The host monitor's route, relative to its base URL.
PATH = "/v1/emergency-checkpoint"


class EmergencyAck(BaseModel):
    """POST /v1/workers/{rank}/emergency-ack: the worker saved (or could not save)."""

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=200)
    ok: bool
    step: int | None = Field(None, ge=0)
    duration_s: float | None = Field(None, ge=0)
    error: str | None = Field(None, max_length=2000)


class EmergencyPending(BaseModel):
    """GET /v1/workers/{rank}/emergency: the round a SIGUSR1 was about (SIGUSR1 carries
    no data). `request_id` is None when no round waits for this rank."""

    request_id: str | None
    remaining_s: float | None


class AckReply(BaseModel):
    """The host monitor's answer to an EmergencyAck."""

    request_id: str
    accepted: bool  # False: the round had already ended; the ack did not count


class EmergencyCheckpointRequest(BaseModel):
    """POST /v1/emergency-checkpoint: signal the workers (SIGUSR1), wait for their acks.

    Idempotent by `request_id`: asking again waits for (or returns) the same round.
    """

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=200)
    timeout_s: float = Field(gt=0, le=3600)


class EmergencyCheckpointResult(BaseModel):
    request_id: str
    acked: dict[int, EmergencyAck] = Field(description="By rank.")
    missing: list[int] = Field(description="Ranks that did not answer in time.")
    elapsed_s: float
    # Defaults: what an older host monitor, which signalled every registered worker, meant.
    declined: list[int] = Field(
        default_factory=list,
        description="Live ranks registered without emergency checkpoints: not signalled.",
    )
    unregistered: list[int] = Field(
        default_factory=list, description="Live ranks not registered (yet): not signalled."
    )


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    """What one node's host monitor answered: its round's result, or why there is none."""

    node: str
    result: EmergencyCheckpointResult | None = None
    #: Why there is no result: no address, the request failed, an error answer.
    error: str | None = None

    @property
    def saved(self) -> dict[int, int | None]:
        """Rank -> the step it saved (None: it did not say), for the workers that saved."""
        if self.result is None:
            return {}
        return {rank: ack.step for rank, ack in self.result.acked.items() if ack.ok}

    @property
    def problems(self) -> list[str]:
        """What keeps this node's part from counting, one line each, naming the node."""
        if self.result is None:
            return [f"{self.node}: {self.error or 'no answer'}"]
        problems = [
            f"{self.node}: rank {rank} failed: {ack.error}"
            for rank, ack in self.result.acked.items()
            if not ack.ok
        ]
        if self.result.missing:
            problems.append(f"{self.node}: no answer from ranks {self.result.missing}")
        return problems

    @property
    def ranks(self) -> list[int]:
        """Every live rank this node's host monitor looked at, signalled or not."""
        result = self.result
        if result is None:
            return []
        return sorted({*result.acked, *result.missing, *result.declined, *result.unregistered})

    @property
    def looked_at(self) -> str:
        """The node and the ranks it looked at, for a message: `node-1 (ranks 2, 3)`."""
        result = self.result
        if result is None:
            return f"{self.node} (no answer)"
        if not self.ranks:
            return f"{self.node} (no live worker)"
        starting = ""
        if result.declined and result.unregistered:
            starting = f"; {_ranks(result.unregistered)} not registered yet"
        return f"{self.node} ({_ranks(self.ranks)}{starting})"


@dataclass(frozen=True, slots=True)
class EmergencyCheckpoint:
    """An emergency checkpoint across nodes: each node's outcome, in the order asked."""

    nodes: tuple[NodeOutcome, ...]

    @property
    def saved(self) -> dict[int, int | None]:
        """Rank -> the step it saved, for every worker that saved."""
        return {rank: step for outcome in self.nodes for rank, step in outcome.saved.items()}

    @property
    def steps(self) -> list[int]:
        """The steps saved, each once, in order."""
        return sorted({step for step in self.saved.values() if step is not None})

    @property
    def problems(self) -> list[str]:
        return [problem for outcome in self.nodes for problem in outcome.problems]

    @property
    def succeeded(self) -> bool:
        """The rule of success (see the module's docstring)."""
        return bool(self.saved) and not self.problems

    @property
    def takes_none(self) -> bool:
        """No worker was signalled, every node answered, and registered workers said they
        take no emergency checkpoints: not a failure (see the module's docstring)."""
        declined = any(o.result is not None and o.result.declined for o in self.nodes)
        # A signalled worker either saved or is a problem: neither means none was.
        return declined and not self.saved and not self.problems

    def none_asked(self, job: str | None) -> str:
        """Why no worker was asked to save (neither `saved` nor `problems`), naming the
        nodes and the ranks their host monitors looked at."""
        of = f"job {job}" if job else "the job"
        if not self.nodes:
            return f"no node of {of} was asked: nothing to save"
        where = ", ".join(o.looked_at for o in self.nodes)
        if self.takes_none:
            return (
                f"{of} takes no emergency checkpoints: no worker of it on {where} "
                "registered for emergency checkpoints"
            )
        return f"no worker of {of} on {where} is registered with its host monitor: nothing to save"

    @property
    def failure(self) -> str:
        """Why it did not succeed, in one line."""
        return "; ".join(self.problems) or self.none_asked(None)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


async def emergency_checkpoint(
    http: httpx.AsyncClient,
    host_monitors: Mapping[str, str | None],
    *,
    request_id: str,
    timeout_s: float,
    http_timeout_s: float,
    before_each: Callable[[], None] | None = None,
    reraise: tuple[type[Exception], ...] = (),
) -> EmergencyCheckpoint:
    """Ask the host monitor of every node at once to have its workers save, and collect
    what each answered.

    `host_monitors`: node -> the base URL of its host monitor (None: not known). `http`
    carries the actuator's credentials. Each round may take `timeout_s`; each request
    `http_timeout_s`, which leaves the answer time to come back. `before_each` runs
    before each request (the leadership fence): what it raises is that node's outcome,
    as a failed request is, but for the `reraise` types, which end the whole round (this
    caller may no longer act at all). Asking again with the same `request_id` joins the
    same round.
    """
    body = EmergencyCheckpointRequest(request_id=request_id, timeout_s=timeout_s)

    async def ask(node: str, base: str | None) -> NodeOutcome:
        if base is None:
            return NodeOutcome(node, error=f"no address for the host monitor of {node}")
        try:
            if before_each is not None:
                before_each()
            response = await http.post(
                f"{base.rstrip('/')}{PATH}",
                json=body.model_dump(mode="json"),
                timeout=http_timeout_s,
            )
            if response.status_code != 200:
                return NodeOutcome(
                    node, error=f"HTTP {response.status_code}: {error_message(response)}"
                )
            return NodeOutcome(node, EmergencyCheckpointResult.model_validate(response.json()))
        except reraise:
            raise
        except Exception as exc:
            return NodeOutcome(node, error=f"{type(exc).__name__}: {exc}")

    outcomes = await asyncio.gather(*(ask(node, base) for node, base in host_monitors.items()))
    return EmergencyCheckpoint(tuple(outcomes))
