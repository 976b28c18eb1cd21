"""docs/configuration.md documents every setting with its real default."""

from __future__ import annotations

from pathlib import Path

from supervisor.config import Settings

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
