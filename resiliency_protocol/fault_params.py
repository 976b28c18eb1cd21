"""The parameters each fault kind takes, as models (the operator API's fields, as each kind
takes them), and the kinds that take a field. The table of kinds (faults.py) names each
kind's model here; this module needs pydantic, which an operator's command never imports.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from resiliency_protocol.faults import FAULTS, FaultKind

Rank = Annotated[int, Field(ge=0)]
Gpu = Annotated[int, Field(ge=0, le=255)]
XidCode = Annotated[int, Field(ge=0, le=1000)]
EccCount = Annotated[int, Field(ge=1)]
DurationS = Annotated[float, Field(gt=0, le=86400)]
Slowdown = Annotated[float, Field(gt=0, le=10)]


class FaultParams(BaseModel):
    """The parameters of one kind; required fields are what the kind cannot do without."""

    model_config = ConfigDict(extra="forbid")


class HeartbeatLossParams(FaultParams):
    duration_s: DurationS | None = None  # unset: until the fault is deleted


class XidParams(FaultParams):
    code: XidCode
    gpu: Gpu | None = None
    rank: Rank | None = None  # the worker whose process the driver names


class EccParams(FaultParams):
    count: EccCount
    gpu: Gpu | None = None


class WorkerParams(FaultParams):
    rank: Rank | None = None  # unset: the node's lowest live rank


class StragglerParams(WorkerParams):
    slowdown: Slowdown | None = None
    duration_s: DurationS | None = None  # unset: until the worker exits


def params_model(kind: FaultKind) -> type[FaultParams] | None:
    """The model of `kind`'s parameters (its row's `params`); None: it takes none."""
    name = FAULTS[kind].params
    if name is None:
        return None
    model = globals()[name]
    assert isinstance(model, type) and issubclass(model, FaultParams), name
    return model


def takers(field: str) -> tuple[FaultKind, ...]:
    """The kinds whose parameters include `field`, in the table's order."""
    return tuple(
        kind
        for kind in FAULTS
        if (model := params_model(kind)) is not None and field in model.model_fields
    )
