"""docs/configuration.md documents every setting with its real default, under the
heading of the group (the part of the supervisor) it belongs to."""

from __future__ import annotations

from pathlib import Path

from supervisor.config import Settings
from supervisor.config_parts import GROUPS, field_names

CONFIGURATION = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()


def test_every_setting_is_in_the_readme_table() -> None:
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = (
            "unset"
            if default is None
            else str(default).lower()
            if isinstance(default, bool)
            else str(default)
        )
        row = f"| `{name}` | `SUPERVISOR_{name.upper()}` | `{shown}` |"
        assert row in CONFIGURATION, f"docs/configuration.md lacks or misstates setting {name}"
        assert field.description, f"setting {name} has no description"


def test_every_setting_is_in_exactly_one_group_and_listed_under_its_heading() -> None:
    names = [name for group in GROUPS for name in field_names(group)]
    assert sorted(names) == sorted(Settings.model_fields), "a setting outside the groups"
    assert len(names) == len(set(names)), "a setting in two groups"
    sections = CONFIGURATION.split("\n### ")[1:]
    by_title = {section.split("\n", 1)[0]: section for section in sections}
    for group in GROUPS:
        section = by_title[group.title]
        listed = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]
        assert listed == field_names(group), group.title


def test_each_group_is_the_settings_own_values() -> None:
    settings = Settings(heartbeat_timeout_s=7.0, max_workload_restarts=2, port=9000)
    assert settings.sensing.heartbeat_timeout_s == 7.0
    assert settings.remediation.limits.max_workload_restarts == 2
    assert settings.service.port == 9000
    for group in GROUPS:
        part = group.of(settings)
        for name in field_names(group):
            assert getattr(part, name) == getattr(settings, name), name
