"""What every group of settings shares."""

from __future__ import annotations

from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict


class SettingsGroup(BaseModel):
    """A group of settings, declared once: `Settings` inherits every group's fields (so
    users set them flat), and a part of the supervisor takes its group alone."""

    # Frozen: a part's snapshot of its settings does not change under it. `Settings`
    # itself, which inherits this, says otherwise for its own instances.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    #: The heading of the group in docs/configuration.md.
    title: ClassVar[str]

    @classmethod
    def of(cls, settings: SettingsGroup) -> Self:
        """This group's values out of the settings (or out of a group that holds them)."""
        return cls(**{name: getattr(settings, name) for name in cls.model_fields})
