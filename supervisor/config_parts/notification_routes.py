"""Notification routes as the settings give them: where to send (a sink) and what (matchers).

Secrets (a webhook URL, which for Slack is the credential itself, and header values such
as an Authorization token) are given inline, or as ``{env: NAME}`` or ``{file: PATH}``,
and are read once when the settings are loaded. They are held as ``SecretStr`` so that
they print as ``**********``; the error naming a missing variable or file never shows a
value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
)

from supervisor.domain import ActionStatus, ActionType, EventType

SinkType = Literal["webhook", "slack", "alertmanager"]
#: How a finished action ended; only finished actions are notified.
Outcome = Literal["succeeded", "failed"]
#: Matches every event type, or every action type.
ANY = "*"

ROUTE_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*)$"


def _read_secret(value: Any) -> Any:
    """A secret given as `{env: NAME}` or `{file: PATH}` is read here; anything else is
    left to the SecretStr validation."""
    if not isinstance(value, dict):
        return value
    if set(value) == {"env"}:
        name = str(value["env"])
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set")
        return os.environ[name]
    if set(value) == {"file"}:
        path = Path(str(value["file"]))
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    raise ValueError("a secret is a string, {env: NAME} or {file: PATH}")


def _not_empty(value: SecretStr) -> SecretStr:
    if not value.get_secret_value():
        raise ValueError("must not be empty")
    return value


#: A string, or `{env: NAME}`, or `{file: PATH}`; read at load time.
Secret = Annotated[SecretStr, BeforeValidator(_read_secret), AfterValidator(_not_empty)]


class Sink(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: SinkType = Field(description="webhook (JSON body), slack or alertmanager.")
    url: Secret = Field(
        description="Where to POST. Alertmanager: its base URL (/api/v2/alerts is added)."
    )
    headers: dict[str, Secret] = Field(
        {}, description="Extra request headers (e.g. Authorization), values secret."
    )
    alert_duration_s: float = Field(
        3600.0,
        gt=0,
        description="Alertmanager: an alert's endsAt is its start plus this, unless an event "
        "that clears it (node_recovered, straggler_recovered) resolves it sooner.",
    )

    def secrets(self) -> list[str]:
        """Every secret value of this sink, to be kept out of errors and logs: the URL,
        its path too (a receiver may quote only that; Slack's path is the credential),
        and the header values."""
        url = self.url.get_secret_value()
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        found = [url, *(v.get_secret_value() for v in self.headers.values())]
        return [*found, path] if len(path) > 1 else found


class Route(BaseModel):
    """A sink and what goes to it: events of `events`, and actions of `actions` that
    ended with one of `outcomes`, of the `jobs` given (all when empty)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        min_length=1, max_length=100, pattern=ROUTE_NAME_PATTERN, description="Unique name."
    )
    sink: Sink
    events: list[EventType | Literal["*"]] = Field(
        [], description='Event types sent ("*": all). Empty: no events.'
    )
    actions: list[ActionType | Literal["*"]] = Field(
        [], description='Types of finished actions sent ("*": all). Empty: no actions.'
    )
    outcomes: list[Outcome] = Field(
        [ActionStatus.SUCCEEDED.value, ActionStatus.FAILED.value],
        min_length=1,
        description="Outcomes of the actions sent.",
    )
    jobs: list[str] = Field([], description="Only these jobs. Empty: any (and none).")


def _unique_names(routes: list[Route]) -> list[Route]:
    names = [r.name for r in routes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"route names must be unique ({', '.join(duplicates)} repeated)")
    return routes


Routes = Annotated[list[Route], AfterValidator(_unique_names)]
