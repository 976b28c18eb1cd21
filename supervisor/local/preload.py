"""What a warm standby of your own Python command imports ahead: the installed modules its
program imports at its top level.

Each rank `supervisor run` starts anew after a fault starts Python and imports torch
again: seconds of CPU per rank, on the path back to training. A warm standby
(host_monitor/standby.py) imports once per node and forks each new rank. It must not run
the program to learn what it imports (importing a script runs it), so its imports are
read from the program's source: the modules its top-level `import` statements name (also
inside a top-level `try` or `if`), kept only when found outside the program's own folder
(the standard library and installed packages, whose import does nothing but define them).
The program's own modules are left to each rank, as they would be without a standby. A
module the standby then cannot import is said in its log and left to the ranks.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from resiliency_protocol.standby_orders import PythonArgs

#: The most modules a standby is asked to preload (the node API's limit).
MAX_PRELOAD = 32
_NEVER = frozenset({"__future__", "__main__"})


def preload_of(command: Sequence[str], cwd: Path | None = None) -> list[str]:
    """The modules a standby of `command` preloads; empty when it should have none (not
    a Python command this interpreter runs, a program whose source cannot be read)."""
    if len(command) < 2 or not _this_python(command[0]):
        return []
    program = PythonArgs.of(tuple(command[1:]))
    if program is None:
        return []
    home = (cwd or Path.cwd()).resolve()
    own: str | None = None
    if program.script is not None:
        source = Path(program.script)
        home = source.resolve().parent
    else:
        assert program.module is not None
        own = program.module.split(".")[0]
        origin = _origin(program.module)
        if origin is None:
            return []
        source = Path(origin)
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except (OSError, SyntaxError, ValueError):
        return []
    kept: list[str] = []
    for name in _imported(tree.body):
        top = name.split(".")[0]
        if name in kept or top in _NEVER or top == own or not _installed(top, home):
            continue
        kept.append(name)
    return kept[:MAX_PRELOAD]


def _this_python(executable: str) -> bool:
    try:
        return os.path.samefile(executable, sys.executable)
    except OSError:
        return False


def _imported(body: list[ast.stmt]) -> Iterator[str]:
    for stmt in body:
        if isinstance(stmt, ast.Import):
            yield from (alias.name for alias in stmt.names)
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.level == 0 and stmt.module:
                yield stmt.module
        elif isinstance(stmt, ast.Try | ast.If):
            yield from _imported(stmt.body)


def _origin(module: str) -> str | None:
    """The source file of `module`, found without running it (its packages' `__init__`
    run: `python -m` runs them too)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return spec.origin


def _installed(top: str, home: Path) -> bool:
    """Found outside `home` (the program's folder, first on its ranks' path), and not
    shadowed there by a module of the program's own."""
    if (home / f"{top}.py").exists() or (home / top).is_dir():
        return False
    if top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
    return bool(places) and not any(
        Path(p).resolve().is_relative_to(home) for p in places if p and p != "frozen"
    )
