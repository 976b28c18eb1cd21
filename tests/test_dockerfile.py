"""The Dockerfile and .dockerignore, checked without a Docker engine (none runs here):
parsed with `dockerfile-parse`, then held against the package (console scripts, what the
build needs), the Helm chart (user, ports, version) and docker-compose.yml.

Not run here: `docker build` itself.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser

from supervisor import cli as supervisor_cli

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PARSER = DockerfileParser(path=str(ROOT / "Dockerfile"))
INSTRUCTIONS: list[dict[str, Any]] = [
    i for i in PARSER.structure if i["instruction"] not in ("COMMENT",)
]


def stages() -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for instruction in INSTRUCTIONS:
        if instruction["instruction"] == "FROM":
            out.append([])
        if out:
            out[-1].append(instruction)
    return out


def values(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == name]


def dockerignore_excludes(path: str) -> bool:
    """Whether Docker leaves `path` out of the build context: the last matching pattern
    of .dockerignore wins, `!` re-includes, and a pattern matching a parent directory
    matches what is under it."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = re.escape(body).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(".*/", "(.*/)?")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_multi_stage_build_on_a_pinned_base() -> None:
    all_stages = stages()
    assert len(all_stages) == 2
    build, runtime = all_stages
    assert values(build, "FROM") == ["${PYTHON_IMAGE} AS build"]
    assert values(runtime, "FROM") == ["${PYTHON_IMAGE} AS runtime"]
    # The base: an exact Python release (major.minor.patch), slim, on a named Debian,
    # the project's minimum Python.
    (arg,) = [
        i["value"]
        for i in INSTRUCTIONS
        if i["instruction"] == "ARG" and i["value"].startswith("PYTHON_IMAGE=")
    ]
    name, _, image = arg.partition("=")
    assert name == "PYTHON_IMAGE"
    match = re.fullmatch(
        r"python:(\d+)\.(\d+)\.(\d+)-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?", image
    )
    assert match, image
    minimum = re.search(r"(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert minimum is not None
    assert match.group(1, 2) == minimum.group(1, 2)
    assert PARSER.baseimage == image


def test_runtime_stage_is_slim_and_non_root() -> None:
    build, runtime = stages()
    # The build stage installs the package (not editable) into a virtual environment;
    # the runtime stage takes that environment and nothing else from it.
    assert any('/opt/venv/bin/pip install ".[${EXTRAS}]"' in run for run in values(build, "RUN"))
    assert "EXTRAS=demo" in values(build, "ARG")  # NumPy for the demo workload, no torch
    copies = values(runtime, "COPY")
    assert copies == ["--from=build /opt/venv /opt/venv"]
    assert not values(runtime, "ADD")
    (user,) = values(runtime, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    # The user exists in the image and owns the work directory.
    (setup,) = values(runtime, "RUN")
    assert f"--uid {uid}" in setup and f"--gid {gid}" in setup
    (workdir,) = values(runtime, "WORKDIR")
    assert f"install -d -o {uid} -g {gid} {workdir}" in setup
    # No setting baked into the image: it would override the settings file.
    envs = " ".join(values(runtime, "ENV") + values(build, "ENV"))
    assert "SUPERVISOR_" not in envs and "HOST_MONITOR_" not in envs
    assert "PATH=/opt/venv/bin:$PATH" in envs


def test_the_image_serves_both_commands() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert {"supervisor", "host-monitor"} <= set(scripts)
    (cmd,) = values(stages()[1], "CMD")
    argv = yaml.safe_load(cmd)  # exec form: a JSON array
    assert isinstance(argv, list) and argv[0] in scripts
    args = supervisor_cli._parser().parse_args(argv[1:])
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8080)
    exposed = sorted(int(p) for e in values(stages()[1], "EXPOSE") for p in shlex.split(e))
    assert exposed == [8080, 9400]


def test_build_context_holds_what_the_build_copies() -> None:
    (build, _) = stages()
    sources = []
    for copy in values(build, "COPY"):
        *srcs, _dest = shlex.split(copy)
        sources += srcs
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(source), f".dockerignore leaves out {source}"
    # Everything the package build reads is copied: pyproject, its readme, the packages.
    assert PYPROJECT["project"]["readme"] in sources
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= set(sources)
    for data in ("supervisor/store/alembic.ini", "supervisor/store/migrations/env.py"):
        assert not dockerignore_excludes(data), data
    # And nothing heavy or private is sent to the engine.
    for path in (".venv/bin/python", ".git/config", "var/supervisor.db", "tests/test_api.py"):
        assert dockerignore_excludes(path), path
    assert dockerignore_excludes("supervisor/__pycache__/cli.cpython-311.pyc")


def test_image_version_agrees_with_the_chart_and_compose() -> None:
    version = PYPROJECT["project"]["version"]
    chart = yaml.safe_load((ROOT / "helm" / "resiliency-supervisor" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["supervisor"]["image"] == f"resiliency-supervisor:{version}"
    # The chart runs the image as the user the Dockerfile creates, on the ports it exposes.
    # (Its security context is a helper, shared by the acting supervisor and the shadow.)
    helpers = ROOT / "helm" / "resiliency-supervisor" / "templates" / "_helpers.tpl"
    uid = values(stages()[1], "USER")[0].partition(":")[0]
    assert f"runAsUser: {uid}" in helpers.read_text()
