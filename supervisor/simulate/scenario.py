"""What a simulation is asked: the cluster, the job, where faults come from, and what to
compare. Read from YAML (`supervisor simulate --scenario FILE`); every field has a
default, so an empty file is a valid (small) scenario."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from resiliency_protocol.checkpoint_reports import Tier
from supervisor.errors import SupervisorError

#: How far a checkpoint tier's copies reach: `process` (the node's host memory: survives
#: a worker's crash or restart, not the node's loss), `node` (copies on peer nodes too:
#: survives a node's loss), `all` (durable storage).
Survives = Literal["process", "node", "all"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterModel(_Model):
    """The nodes: those the job runs on (replicas x nodes per replica) and the spares."""

    gpus_per_node: int = Field(8, ge=1, le=64)
    num_dp_replicas: int = Field(4, ge=1, description="Data-parallel replicas the job runs.")
    min_num_dp_replicas: int | None = Field(
        None, ge=1, description="Never scaled below this (default: num_dp_replicas)."
    )
    num_nodes_per_dp: int = Field(4, ge=1, description="Nodes in one replica.")
    spares: int = Field(1, ge=0, description="Idle healthy nodes, ready to swap in.")
    repair_s: float = Field(
        4 * 3600.0, gt=0, description="A failed node's time out of service before it is back."
    )

    @property
    def job_nodes(self) -> int:
        return self.num_dp_replicas * self.num_nodes_per_dp

    @property
    def nodes(self) -> int:
        return self.job_nodes + self.spares


class TierModel(_Model):
    """A checkpoint tier: how often it is saved, what a save and a restore cost."""

    name: str = Field(min_length=1, max_length=64)
    every_s: float = Field(gt=0, description="Seconds of training between two saves.")
    save_s: float = Field(0.0, ge=0, description="Time training is blocked by a save.")
    restore_s: float = Field(0.0, ge=0, description="Time to load it when restarting.")
    survives: Survives = "all"


class JobModel(_Model):
    """The training job: its step time, checkpoint tiers and restart costs."""

    name: str = Field("train", pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*)$", max_length=63)
    step_s: float = Field(2.0, gt=0, description="Seconds per training step.")
    tiers: tuple[TierModel, ...] = (
        TierModel(name=Tier.RAM, every_s=600, save_s=1, restore_s=10, survives="process"),
        TierModel(name=Tier.DURABLE, every_s=3600, save_s=10, restore_s=120, survives="all"),
    )
    startup_s: float = Field(
        50.0,
        ge=0,
        description="From (re)starting the workers to their first step, "
        "rendezvous included, not counting the checkpoint's restore.",
    )
    in_place_restart_s: float = Field(
        30.0, ge=0, description="Start-up of a restart in place (the processes only)."
    )
    emergency_checkpoint_s: float = Field(
        5.0, ge=0, description="Time an emergency checkpoint of the healthy workers takes."
    )
    emergency_checkpoint_survives: Survives = Field(
        "node", description="Where an emergency checkpoint lands (default: RAM and peers)."
    )

    @model_validator(mode="after")
    def _unique_tiers(self) -> JobModel:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError("tiers: tier names must be unique")
        if "emergency" in names:
            raise ValueError("tiers: 'emergency' is the name of emergency checkpoints")
        return self


class FailureMix(_Model):
    """Failures per cause, as rates: per node-hour or per GPU-hour (`per`)."""

    per: Literal["node_hour", "gpu_hour"] = "node_hour"
    #: cause -> failures per unit (see `supervisor.simulate.fault_sources.CAUSES`).
    rates: dict[str, float] = Field(default_factory=dict)
    #: How long a `network` fault keeps the node unreachable.
    network_outage_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _known_causes(self) -> FailureMix:
        from supervisor.simulate.fault_sources import CAUSES

        for cause, rate in self.rates.items():
            if cause not in CAUSES:
                raise ValueError(
                    f"rates.{cause}: unknown cause (known: {', '.join(sorted(CAUSES))})"
                )
            if not rate >= 0:
                raise ValueError(f"rates.{cause}: must be a non-negative rate, got {rate}")
        return self


class Scenario(_Model):
    """One simulation: a cluster, a job, faults from a trace or a failure mix, settings."""

    days: float = Field(1.0, gt=0, le=3650, description="Simulated time, in days.")
    seed: int = Field(0, description="Seeds the failure mix (same seed, same faults).")
    cluster: ClusterModel = ClusterModel()
    job: JobModel = JobModel()
    failures: FailureMix | None = None
    #: A trace of faults (JSON lines) instead of, or with, the failure mix.
    trace: Path | None = None
    #: Supervisor settings for every run (detection, limits, policy...), as in the YAML
    #: config file; `variants` override them per run.
    settings: dict[str, Any] = Field(default_factory=dict)
    #: Runs to compare side by side, on the same faults: name -> settings overrides.
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.days * 86400.0


class ScenarioError(SupervisorError, ValueError):
    """A scenario that cannot be run; the message names the field."""


def load_scenario(path: Path | None, **overrides: Any) -> Scenario:
    """Read a scenario file (YAML); `overrides` replace its top-level fields."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ScenarioError(f"cannot read scenario {path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ScenarioError(f"scenario {path}: expected a mapping at the top level")
        data = loaded
        if isinstance(data.get("trace"), str) and not Path(data["trace"]).is_absolute():
            data["trace"] = str(path.parent / data["trace"])
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
