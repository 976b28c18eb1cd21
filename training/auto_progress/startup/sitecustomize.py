"""Imported by the interpreter at start (site.py) in a worker whose PYTHONPATH starts with
this directory: activates `training.auto_progress`, then runs the `sitecustomize` this one
shadows (further down sys.path: the distribution's, the user's), if any.

This directory is taken off PYTHONPATH for the processes the worker starts (data loader
workers, tools it runs): only the worker itself counts its steps. Nothing here may stop
the interpreter: a failure is one line on stderr.
"""

from __future__ import annotations

import os
import sys


def _main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    _leave_path(here)
    try:
        from training import auto_progress

        auto_progress.activate()
    except Exception as exc:  # e.g. `training` not importable by this interpreter
        print(f"training.auto_progress: not activated: {exc!r}", file=sys.stderr)
    _chain(here)


def _leave_path(here: str) -> None:
    """This directory off sys.path and off the PYTHONPATH children inherit."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in entries if not p or os.path.abspath(p) != here]
    if len(kept) == len(entries):
        return
    if any(kept):
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        del os.environ["PYTHONPATH"]


def _chain(here: str) -> None:
    """Run the `sitecustomize` that would have run without this one, as site.py would
    have (its errors go to site.py, which reports them as usual)."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_main()
