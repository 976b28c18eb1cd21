"""A training image's install: `pip install 'resiliency-supervisor[training]'` in a clean
virtual environment brings what the training processes import and nothing of the
service; a save and a restore of a PyTorch state then run there, and the service's
command says which extra it needs instead of failing with a traceback.

The one environment is made once for the module (a wheel of the project is built, the
rest comes from uv's cache).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
SERVICE_ONLY = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg", "kubernetes")
SERVICE_ONLY += ("pydantic_settings", "prometheus_client", "pynvml", "numpy")

# Run with the clean environment's Python, from a directory outside the repository, so
# that every import comes from what was installed.
SAVE_AND_RESTORE = r"""
import importlib.util, json, sys, tempfile
import torch
from training.checkpoint import Checkpointer, CheckpointSettings

root = tempfile.mkdtemp()
settings = CheckpointSettings(
    in_memory_checkpointing_freq=2, s3_checkpointing_freq=4,
    ram_dir=f"{root}/ram", durable_dir=f"{root}/durable", enable_peer_ckpt=False,
)
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
ckpt = Checkpointer(model, opt, settings=settings, job="install")
assert ckpt.restore() == 0
for step in range(1, 5):
    model(torch.randn(4, 8)).sum().backward()
    opt.step(); opt.zero_grad()
    ckpt.step_done(step)
ckpt.close()
fresh = torch.nn.Linear(8, 8)
again = Checkpointer(fresh, torch.optim.AdamW(fresh.parameters()), settings=settings, job="install")
restored = again.restore()
again.close()
pairs = zip(model.state_dict().values(), fresh.state_dict().values())
same = all(torch.equal(a, b) for a, b in pairs)
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]
print(json.dumps({"restored": restored, "same": same, "absent": missing,
                  "training_from": __import__("training").__file__}))
"""


@pytest.fixture(scope="module")
def training_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("training-install")
    env_dir = home / "venv"
    # uv, the installer `make` uses: pip takes the same metadata, a minute slower.
    uv = Path(sys.executable).parent / "uv"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    run = functools.partial(subprocess.run, check=True, timeout=600, cwd=home, env=env)
    run([str(uv), "venv", "--quiet", "--python", sys.executable, str(env_dir)])
    python = env_dir / "bin" / "python"
    linked = _link_torch(python, home / "torch")
    # What is linked is not installed again (uv, unlike pip, does not look through a .pth).
    excludes = home / "linked.txt"
    excludes.write_text("".join(f"{name}\n" for name in sorted(linked)))
    install = [str(uv), "pip", "install", "--quiet", "--python", str(python)]
    run([*install, "--excludes", str(excludes), f"{REPO}[training]"])
    yield python


def _link_torch(python: Path, into: Path) -> set[str]:
    """The exact torch build this machine's tests use, and every distribution it requires
    (its CUDA libraries are some 3 GB), linked into the clean environment with their
    distribution records and their compiled bytecode; returns their names. The installer
    brings the training extra's other dependencies itself. Unpacking the same gigabytes
    again would prove nothing more."""
    into.mkdir()
    closure = _requirement_closure("torch")
    for dist in closure:
        for name in _top_level_names(dist):
            target = Path(str(dist.locate_file(name)))
            if target.exists() and not (into / name).exists():
                (into / name).symlink_to(target)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "linked_torch.pth").write_text(f"{into}\n")
    return {canonicalize_name(dist.metadata["Name"]) for dist in closure}


def _requirement_closure(name: str) -> list[metadata.Distribution]:
    """`name`'s distribution and those it requires on this machine, extras followed."""
    found: dict[str, metadata.Distribution] = {}
    todo: list[tuple[str, frozenset[str]]] = [(name, frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        wanted, extras = todo.pop()
        key = canonicalize_name(wanted)
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        try:
            dist = metadata.distribution(wanted)
        except metadata.PackageNotFoundError:
            continue  # pip brings it
        found[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return list(found.values())


def _top_level_names(dist: metadata.Distribution) -> set[str]:
    """The names a distribution puts at the top of site-packages: its packages and
    modules, and its own record (``*.dist-info``)."""
    names = {PurePosixPath(str(f)).parts[0] for f in dist.files or []}
    return {n for n in names if n not in ("..", "__pycache__") and not n.endswith(".pth")}


def test_the_training_extra_saves_and_restores_without_the_service(
    training_env: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [str(training_env), "-c", SAVE_AND_RESTORE, *SERVICE_ONLY],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["restored"] == 4 and result["same"], result
    # Installed, not read from this checkout; and none of the service's packages came.
    assert not result["training_from"].startswith(str(REPO)), result
    assert sorted(result["absent"]) == sorted(SERVICE_ONLY), result


@pytest.mark.parametrize(
    ("command", "extra"), [("supervisor", "server"), ("host-monitor", "host-monitor")]
)
def test_the_service_commands_name_the_extra_they_need(
    training_env: Path, tmp_path: Path, command: str, extra: str
) -> None:
    done = subprocess.run(
        [str(training_env.parent / command), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.endswith(f"pip install 'resiliency-supervisor[{extra}]'"), line
