"""What a warm standby of your own Python command preloads (supervisor/local/preload.py):
the installed modules its program imports at its top level, read from its source, never
run; nothing of the program's own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from supervisor.local.preload import MAX_PRELOAD, preload_of
from supervisor.run_cli import add_commands, options

SCRIPT = """\
from __future__ import annotations
import json, xml.dom
import helper
from training.checkpoint import Checkpointer
from . import sibling
try:
    import csv
except ImportError:
    csv = None
if True:
    from email import message
import not_a_module_anywhere
import json

def main():
    import sqlite3

raise SystemExit("a script's top level must never run")
"""


def write_job(folder: Path) -> Path:
    folder.mkdir()
    (folder / "helper.py").write_text("")
    script = folder / "train.py"
    script.write_text(SCRIPT)
    return script


def test_a_script_preloads_what_it_imports_from_outside_its_folder(tmp_path: Path) -> None:
    script = write_job(tmp_path / "job")
    for command in ([sys.executable, str(script)], [sys.executable, "-u", str(script), "--x"]):
        assert preload_of(command) == ["json", "xml.dom", "training.checkpoint", "csv", "email"]


def test_a_module_preloads_nothing_of_its_own_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import mypkg.model\nimport helper\nimport json\n")
    (tmp_path / "helper.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preload_of([sys.executable, "-u", "-m", "mypkg.train"], cwd=tmp_path) == ["json"]


def test_commands_a_standby_cannot_run_preload_nothing(tmp_path: Path) -> None:
    script = write_job(tmp_path / "job")
    for command in (
        ["/bin/sh", str(script)],  # not this interpreter
        [sys.executable, "-c", "import json"],
        [sys.executable, "-X", "dev", str(script)],
        [sys.executable, str(tmp_path / "missing.py")],
        [sys.executable, "-m", "no_such_module_anywhere"],
        [sys.executable],
    ):
        assert preload_of(command) == [], command
    (tmp_path / "broken.py").write_text("import json\ndef (:\n")
    assert preload_of([sys.executable, str(tmp_path / "broken.py")]) == []


def test_at_most_as_many_as_the_node_api_takes(tmp_path: Path) -> None:
    names = sorted(sys.stdlib_module_names - {"__future__", "antigravity", "this"})[:40]
    script = tmp_path / "many.py"
    script.write_text("".join(f"import {name}\n" for name in names))
    assert len(preload_of([sys.executable, str(script)])) == MAX_PRELOAD


def test_supervisor_run_asks_for_a_standby_of_its_script_unless_told_not_to(
    tmp_path: Path,
) -> None:
    script = write_job(tmp_path / "job")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    argv = ["run", "--run-dir", str(tmp_path / "run"), str(script)]
    job = options(parser.parse_args(argv)).job_spec(["node-0"])
    assert job.standby_preload == preload_of(job.command)
    assert "training.checkpoint" in job.standby_preload
    cold = options(parser.parse_args([*argv[:1], "--no-warm-standby", *argv[1:]]))
    assert cold.job_spec(["node-0"]).standby_preload == []
