"""Loads the user's policy from `module:Class` or `path/to/file.py:Class`.

Policies are plain Python files, so changing one needs no new image: mount the file
(Helm puts it in a ConfigMap) and point `policy` at it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from supervisor.errors import SupervisorError
from supervisor.policy import Policy


class PolicyLoadError(SupervisorError):
    """The configured policy cannot be loaded; the message says why, in one line."""


def load_policy(spec: str) -> Policy:
    target, sep, class_name = spec.rpartition(":")
    if not sep or not target or not class_name:
        raise PolicyLoadError(
            f"policy {spec!r}: expected 'module:Class' or 'path/to/file.py:Class'"
        )
    if target.endswith(".py") or "/" in target:
        module = _load_file(Path(target), spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PolicyLoadError(f"policy {spec!r}: cannot import {target}: {exc}") from None
        except Exception as exc:  # a syntax error or a crash at import time
            raise PolicyLoadError(f"policy {spec!r}: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        found = sorted(
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, Policy) and value is not Policy
        )
        raise PolicyLoadError(
            f"policy {spec!r}: {target} has no {class_name}"
            + (f" (its policies: {', '.join(found)})" if found else "")
        )
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyLoadError(
            f"policy {spec!r}: {class_name} is not a subclass of supervisor.policy.Policy"
        )
    try:
        return cls()
    except Exception as exc:
        raise PolicyLoadError(f"policy {spec!r}: {class_name}() failed: {exc}") from None


def _load_file(path: Path, spec: str) -> object:
    if not path.is_file():
        raise PolicyLoadError(f"policy {spec!r}: file not found: {path}")
    module_name = f"supervisor_user_policy_{abs(hash(str(path.resolve())))}"
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise PolicyLoadError(f"policy {spec!r}: cannot load {path}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise PolicyLoadError(f"policy {spec!r}: {type(exc).__name__}: {exc}") from None
    return module
