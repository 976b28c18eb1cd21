"""Run a callback right after a module is imported, without importing it: a meta path
finder that wraps the module's loader. `training.auto_progress` installs torch's optimizer
hook this way when torch.optim is imported (`import torch` does), so that a process that
never imports torch never pays for it.

Imports only what the interpreter has loaded at start: this runs in every worker process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec

TYPE_CHECKING = False  # typing's, without importing typing at every interpreter start
if TYPE_CHECKING:
    from types import ModuleType


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once module `name` is imported: now if it is already, else
    right after it executes (in the importing thread, under its import lock)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))


def cancel_waiting() -> None:
    """Call no callback still waiting for its module's import (a process taking over
    from another's state: a forked child)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]


class _AfterImport:
    """Finds no module itself: it asks the finders after it for `name`'s spec and wraps
    that spec's loader. It leaves sys.meta_path at its first find: every later import
    goes on as if it had never been there."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self._name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec: ModuleSpec | None = None
            if find_spec is not None:
                spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None  # not found: the import fails as it would have
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _ThenCall(loader, self._callback)  # type: ignore[assignment]
        return spec


class _ThenCall:
    """`loader`, and then the callback. Gives the module its own loader back once it ran,
    so that nothing of ours is left on it."""

    def __init__(self, loader: object, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create: Callable[[ModuleSpec], ModuleType | None] = self._loader.create_module  # type: ignore[attr-defined]
        return create(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)  # type: ignore[attr-defined]
        module.__loader__ = self._loader  # type: ignore[assignment]
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader  # type: ignore[assignment]
        self._callback(module)

    def __getattr__(self, name: str) -> object:
        # What else the import system or a tool asks of a loader (get_code, is_package,
        # get_resource_reader, ...), while the module executes.
        return getattr(self._loader, name)
