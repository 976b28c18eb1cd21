"""Jobs as the API shows them."""

from __future__ import annotations

from pydantic import BaseModel, Field

from supervisor.domain import JobView
from supervisor.job_state import JobState


class JobOut(BaseModel):
    name: str
    num_dp_replicas: int
    min_num_dp_replicas: int
    max_num_dp_replicas: int
    num_nodes_per_dp: int
    nodes: list[str]
    last_step: int | None
    hang_timeout_s: float | None = Field(
        description="Hang timeout in force (learned or fixed); null while warming up."
    )
    state: JobState = Field(
        description="running; recovering (a remedy in flight); finishing (its workers left "
        "their loop); finished (none left at work); given_up (its restart budget spent, "
        "until an operator resets it)."
    )
    given_up_reason: str | None = Field(
        None, description="Why the supervisor gave up healing the job (state given_up)."
    )
    no_progress_restarts: int = Field(
        0,
        description="Remedies in a row not followed by progress (max_no_progress_restarts "
        "gives the job up).",
    )

    @classmethod
    def of(
        cls,
        j: JobView,
        hang_timeout_s: float | None,
        state: JobState,
        *,
        given_up_reason: str | None = None,
        no_progress_restarts: int = 0,
    ) -> JobOut:
        return cls(
            state=state,
            given_up_reason=given_up_reason,
            no_progress_restarts=no_progress_restarts,
            name=j.name,
            num_dp_replicas=j.num_dp_replicas,
            min_num_dp_replicas=j.min_num_dp_replicas,
            max_num_dp_replicas=j.max_num_dp_replicas,
            num_nodes_per_dp=j.num_nodes_per_dp,
            nodes=list(j.nodes),
            last_step=j.last_step,
            hang_timeout_s=None if hang_timeout_s is None else round(hang_timeout_s, 3),
        )
