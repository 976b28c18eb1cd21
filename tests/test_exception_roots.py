"""Each package's exceptions sit under one root, and each is named in the tree its errors
module draws: a reader finds every error a package can raise in one place."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

ROOTS = {
    "supervisor": ("supervisor.errors", "SupervisorError"),
    "host_monitor": ("host_monitor.errors", "HostMonitorError"),
    "training": ("training.errors", "TrainingError"),
    "resiliency_protocol": ("resiliency_protocol.exceptions", "ProtocolError"),
}


def _modules(package: str) -> list[ModuleType]:
    root = importlib.import_module(package)
    modules = [root]
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        if info.name.endswith("__main__"):
            continue  # runs a command when imported
        modules.append(importlib.import_module(info.name))
    return modules


def _exceptions(package: str) -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in _modules(package):
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found[f"{module.__name__}.{name}"] = value
    return found


def _drawn_trees(package: str) -> str:
    """The docstrings of the package's `errors` and `exceptions` modules: where its trees
    are drawn."""
    names = ("errors", "exceptions")
    return "\n".join(
        m.__doc__ or "" for m in _modules(package) if m.__name__.rsplit(".", 1)[-1] in names
    )


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_exception_of_a_package_derives_from_its_root(package: str) -> None:
    module, name = ROOTS[package]
    root = getattr(importlib.import_module(module), name)
    exceptions = _exceptions(package)
    assert exceptions, package
    outside = sorted(qual for qual, cls in exceptions.items() if not issubclass(cls, root))
    assert not outside, f"not under {name}: {outside}"


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_public_exception_is_drawn_in_its_package_tree(package: str) -> None:
    trees = _drawn_trees(package)
    missing = sorted(
        qual
        for qual, cls in _exceptions(package).items()
        if not cls.__name__.startswith("_") and cls.__name__ not in trees
    )
    assert not missing, f"exceptions missing from the tree in {package}'s errors modules: {missing}"
