"""The settings of the control loop: what is sensed, the job's shape, the remediation
ladder, the actions, and what the service is composed of."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from resiliency_protocol.shared_settings import (
    DEFAULT_GPU_REPORT_COOLDOWN_S,
    DEFAULT_HEARTBEAT_POLLING_PERIOD_S,
)
from supervisor.config_parts.group import SettingsGroup
from supervisor.policy import PolicyLimits
from supervisor.xid import XidResponse

BackendName = Literal["dry_run", "local", "kubernetes"]


class SensingSettings(SettingsGroup):
    """The sensor: liveness, hangs, flapping, GPU reports, stragglers."""

    title = "Sensing"

    heartbeat_polling_period_s: float = Field(
        DEFAULT_HEARTBEAT_POLLING_PERIOD_S,
        gt=0,
        description="How often host monitors send a heartbeat.",
    )
    heartbeat_timeout_s: float = Field(
        15.0, gt=0, description="A node is declared lost this long after its last heartbeat."
    )
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fixed hang timeout. Unset: learned per job from observed step intervals.",
    )
    hang_min_timeout_s: float = Field(
        60.0, gt=0, description="Lower bound of the learned hang timeout."
    )
    hang_safety_factor: float = Field(
        5.0, ge=1, description="Learned hang timeout = longest observed step interval x this."
    )
    hang_warmup_intervals: int = Field(
        5, ge=0, description="Step intervals observed before hang detection starts for a job."
    )
    finishing_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A job's workers left their loop (finishing) this long ago and one is "
        "still finishing or at work: a hang of kind finishing. Not watched for hangs "
        "meanwhile.",
    )
    flap_window_s: float = Field(
        300.0, gt=0, description="Window in which repeated losses of one node count as flapping."
    )
    flap_max_losses: int = Field(
        3, ge=2, description="Losses within flap_window_s that mark a node as flapping."
    )
    peer_cut_confirm_s: float | None = Field(
        None,
        ge=0,
        description="A node judged cut off from its peers (node_cut_off) is reported once "
        "the judgement has held this long. Unset: two probe rounds and a heartbeat period "
        "(2 x max(heartbeat_polling_period_s, 1 s) + heartbeat_polling_period_s), so that "
        "what nodes said during a blip that cut one from everyone, the supervisor included, "
        "is replaced by newer reports first.",
    )
    gpu_report_cooldown_s: float = Field(
        DEFAULT_GPU_REPORT_COOLDOWN_S,
        ge=0,
        description="Repeats of the same GPU error on a node within this are dropped.",
    )
    straggler_threshold: float = Field(
        1.1,
        gt=1,
        description="A rank whose compute time per step is this many times its job's median "
        "is slow (1.1: 10% slower).",
    )
    straggler_window_s: float = Field(
        30.0,
        gt=0,
        description="How long a rank must stay slow (or fast again) before straggler (or "
        "straggler_recovered) is raised; also the window its compute times are scored over.",
    )
    agent_clock_skew_s: float = Field(
        300.0,
        gt=0,
        description="A time an agent sends (GPU reports, checkpoint reports) further than "
        "this from the supervisor's clock is refused (422 naming the field).",
    )
    xid_responses: dict[int, XidResponse] = Field(
        {},
        description="Per XID code, a response instead of the XID table's: restart_workload, "
        'replace_node or ignore (for example {"94": "restart_workload"}).',
    )

    @model_validator(mode="after")
    def _check_heartbeat_timeout(self) -> Self:
        if self.heartbeat_timeout_s <= self.heartbeat_polling_period_s:
            raise ValueError(
                "heartbeat_timeout_s must be greater than heartbeat_polling_period_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_polling_period_s})"
            )
        return self


class WorkloadSettings(SettingsGroup):
    """The shape of the supervised job, and the bounds of its scaling."""

    title = "Workload"

    num_dp_replicas: int = Field(4, ge=1, description="Data-parallel replicas of a job.")
    min_num_dp_replicas: int = Field(2, ge=1, description="Never scale a job below this.")
    max_num_dp_replicas: int = Field(4, ge=1, description="Never scale a job above this.")
    num_nodes_per_dp: int = Field(4, ge=1, description="Nodes in one data-parallel replica.")

    @model_validator(mode="after")
    def _check_replica_bounds(self) -> Self:
        if not self.min_num_dp_replicas <= self.num_dp_replicas <= self.max_num_dp_replicas:
            raise ValueError(
                "need min_num_dp_replicas <= num_dp_replicas <= max_num_dp_replicas "
                f"(got {self.min_num_dp_replicas}, {self.num_dp_replicas}, "
                f"{self.max_num_dp_replicas})"
            )
        return self


class RemediationSettings(SettingsGroup):
    """The remediation ladder the policy climbs (`limits`: what a policy sees)."""

    title = "Remediation"

    max_in_job_restarts: int = Field(
        3, ge=0, description="Restarts of a job's workers in place before a workload restart."
    )
    max_workload_restarts: int = Field(
        0, ge=0, description="Restarts on a failing node before it is hot-swapped for a spare."
    )
    enable_workload_scaling: bool = Field(
        False, description="Allow scaling a job down when no spare exists, and back up later."
    )
    restart_window_s: float = Field(
        3600.0, gt=0, description="Window over which restarts of a job are counted and bounded."
    )
    max_restarts_in_window: int = Field(
        30,
        ge=1,
        description="Disruptive actions per job per window before the policy gives up: a "
        "safety net beyond max_no_progress_restarts.",
    )
    max_no_progress_restarts: int = Field(
        3,
        ge=1,
        description="Remedies in a row not followed by training progress (every rank past "
        "the step it stood at) before the job is judged unhealable and given up.",
    )

    @property
    def limits(self) -> PolicyLimits:
        """What a policy sees of the ladder."""
        return PolicyLimits(
            max_in_job_restarts=self.max_in_job_restarts,
            max_workload_restarts=self.max_workload_restarts,
            enable_workload_scaling=self.enable_workload_scaling,
            restart_window_s=self.restart_window_s,
            max_restarts_in_window=self.max_restarts_in_window,
            max_no_progress_restarts=self.max_no_progress_restarts,
        )


class ActuatorSettings(SettingsGroup):
    """How long an action may take and how often it is tried."""

    title = "Actuator"

    emergency_checkpoint_timeout_s: float = Field(
        60.0, gt=0, description="Time allowed for healthy workers to save an emergency checkpoint."
    )
    action_timeout_s: float = Field(300.0, gt=0, description="Time allowed for any other action.")
    action_max_attempts: int = Field(3, ge=1, description="Attempts per action (retryable errors).")
    action_retry_backoff_s: float = Field(
        1.0, ge=0, description="First retry delay; doubles on each further attempt."
    )


class RuntimeSettings(SettingsGroup):
    """What the service is composed of: its backend, its policy, and dry run."""

    title = "Backend and policy"

    backend: BackendName = Field(
        "dry_run",
        description="Where actions are carried out. `dry_run` carries out none: the "
        "supervisor is a dry run, as with `dry_run: true`.",
    )
    dry_run: bool = Field(
        False,
        description="Record what the policy decides, and do nothing: the actions are marked "
        "dry run and counted apart from those carried out; on Kubernetes the cluster is "
        "still watched, read only. A shadow of the acting supervisor.",
    )
    policy: str = Field(
        "policies.default:DefaultPolicy",
        min_length=1,
        description="The policy: `module:Class` or a path to a .py file (`file.py:Class`).",
    )
