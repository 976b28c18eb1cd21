"""What each action type takes in its `params`: one model per type, the contract between
the policies (and operators) that ask for an action and the backends that carry it out.

An `ActionRequest` keeps its params as a plain mapping (that is what is stored, hashed
into its idempotency key and sent); `supervisor.policy.actions` builds it from these
models, the API checks an operator's params against them (`check_params`), and backends
read them back typed (`params_of`; `checked_params` and `params_for` in
supervisor/actuator/backend.py turn a misfit into an ActionError). Keys a model does not
declare are kept as they are and ignored (an operator may annotate an action).
docs/http-api.md's action table lists these fields, and a test holds the two together.

Pure: imports the domain, the error root and pydantic only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.domain import ActionRecord, ActionRequest, ActionType
from supervisor.errors import SupervisorError

#: Replicas an action may ask for: far above any job, far below what overflows.
MAX_REPLICAS = 100_000


class InvalidParams(SupervisorError, ValueError):
    """An action's params do not fit its type; the message starts with `params.<field>`."""


class ActionParams(BaseModel):
    """Base of the params models: frozen, strict (no "3" for 3), an undeclared field is
    refused when built."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True
    )

    action_type: ClassVar[ActionType]

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> Self:
        """Checked: InvalidParams names the first field that does not fit."""
        known = {k: v for k, v in params.items() if k in cls.model_fields}
        try:
            return cls.model_validate(known)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise InvalidParams(f"params.{where}: {err['msg']} ({cls.action_type.value})") from None

    def mapping(self) -> dict[str, Any]:
        """The params as an action stores them: unset fields left out."""
        return self.model_dump(mode="json", exclude_none=True)


class EmergencyCheckpointParams(ActionParams):
    action_type = ActionType.EMERGENCY_CHECKPOINT
    exclude_nodes: list[str] = Field(default_factory=list)
    """Nodes not asked (the failed one): their workers cannot answer."""


class RestartInPlaceParams(ActionParams):
    action_type = ActionType.RESTART_IN_PLACE
    in_process: bool | None = None
    """True: heal in-process (the survivors keep their processes); False: a full restart;
    unset: the job's default."""


class RestartWorkloadParams(ActionParams):
    action_type = ActionType.RESTART_WORKLOAD


class HotSwapParams(ActionParams):
    action_type = ActionType.HOT_SWAP
    spare: str | None = None
    """The spare to take; unset: the backend picks one."""
    in_process: bool | None = None
    """As for `restart_in_place`."""


class ScaleDownParams(ActionParams):
    action_type = ActionType.SCALE_DOWN
    to_replicas: int = Field(ge=0, le=MAX_REPLICAS)
    """Data-parallel replicas after it; the job's own bounds
    (`min_num_dp_replicas`, `max_num_dp_replicas`) are the backend's to check."""
    exclude_node: str | None = None
    """The bad node, left out of the smaller job."""


class ScaleUpParams(ActionParams):
    action_type = ActionType.SCALE_UP
    to_replicas: int = Field(ge=0, le=MAX_REPLICAS)
    """As for `scale_down`."""


class CordonParams(ActionParams):
    action_type = ActionType.CORDON


class UncordonParams(ActionParams):
    action_type = ActionType.UNCORDON


class ForceDeletePodParams(ActionParams):
    action_type = ActionType.FORCE_DELETE_POD
    pod: str = Field(min_length=1)
    """The pod stuck terminating: that very pod only."""
    namespace: str | None = None
    uid: str | None = None
    """Deleted only if the pod still has this UID."""


P = TypeVar("P", bound=ActionParams)

#: Action type -> its params model; every type has one.
ACTION_PARAMS: Mapping[ActionType, type[ActionParams]] = {
    model.action_type: model
    for model in (
        EmergencyCheckpointParams,
        RestartInPlaceParams,
        RestartWorkloadParams,
        HotSwapParams,
        ScaleDownParams,
        ScaleUpParams,
        CordonParams,
        UncordonParams,
        ForceDeletePodParams,
    )
}


def check_params(type_: ActionType, params: Mapping[str, Any]) -> ActionParams:
    """`params` checked against `type_`'s model (InvalidParams names the field)."""
    return ACTION_PARAMS[type_].from_mapping(params)


def params_of(action: ActionRequest | ActionRecord, model: type[P]) -> P:
    """The typed params of `action`, which must be of `model`'s type."""
    if action.type is not model.action_type:
        raise TypeError(f"{model.__name__} is not the params of a {action.type.value} action")
    return model.from_mapping(action.params)
