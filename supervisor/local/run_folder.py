"""The run folder of `supervisor run` and `supervisor demo` (a local cluster's state, logs
and checkpoints), emptied when the next run starts in it, and what a previous job left in
the folder of `python -m supervisor.local.bootstrap`.

Only what a run of this tool made is ever removed: a run marks the folder it creates (or
finds empty) with a marker file, and a folder that holds anything without it is the
user's, refused untouched. A run holds a lock on the marker while it lasts, so that a
second run does not empty the folder of one still going (the default folder is shared
by every project of the user).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from supervisor.errors import SupervisorError

#: In every run folder: a folder is emptied only with it.
MARKER = ".resiliency-supervisor-run"
MARKER_TEXT = (
    "A run folder of resiliency-supervisor (supervisor run, supervisor demo): the next run "
    "in this folder empties it.\n"
)
#: In bootstrap's folder, shared with others (the host monitors' own folders): only the
#: entries bootstrap writes are removed, and only with it.
JOB_MARKER = ".resiliency-supervisor-job"
JOB_MARKER_TEXT = (
    "A run folder of resiliency-supervisor's bootstrap: the next bootstrap in this folder "
    "removes the previous job's entries (cluster.json, job, durable, output, nodes).\n"
)
#: The default run folders' parent in the user's state folder.
STATE_NAME = "resiliency-supervisor"


class RunFolderError(SupervisorError, ValueError):
    """A folder that cannot be a run's: the message names it and says what to do."""


def default_run_dir(name: str) -> Path:
    """`$XDG_STATE_HOME/resiliency-supervisor/NAME`; without XDG_STATE_HOME (or with a
    relative one, which the XDG spec says to ignore), under ~/.local/state."""
    state = os.environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(state):
        return Path(state) / STATE_NAME / name
    try:
        return Path.home() / ".local" / "state" / STATE_NAME / name
    except RuntimeError:  # no HOME, and no home in the password database
        raise RunFolderError(
            "no default folder: neither XDG_STATE_HOME nor a home folder is set; give one"
        ) from None


def _not_ours(path: Path) -> RunFolderError:
    return RunFolderError(
        f"{path} is not empty and not a previous run's folder (no {MARKER} in it); a run "
        "empties its folder, so give a new or empty one"
    )


def _lock(handle: IO[bytes], path: Path) -> None:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunFolderError(
            f"{path} is in use by another run; wait for it to end, or give another folder"
        ) from None


def check(path: Path) -> None:
    """Raise RunFolderError unless `path` may be a run's folder: new, empty, or a
    previous run's that no run uses now. Changes nothing."""
    try:
        if not path.exists():
            return
        if not path.is_dir():
            raise RunFolderError(f"{path} is not a folder; give a folder for the run")
        marker = path / MARKER
        if marker.is_file():
            with marker.open("rb") as handle:
                _lock(handle, path)  # released when closed
            return
        if any(path.iterdir()):
            raise _not_ours(path)
    except RunFolderError:
        raise
    except OSError as exc:
        raise RunFolderError(f"{path}: {exc.strerror or exc}") from None


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def claim(path: Path) -> IO[bytes]:
    """Make `path` this run's folder: created, or a previous run's emptied, with the
    marker in it, locked until the file returned is closed. A folder that holds anything
    else is refused (RunFolderError) and left as it was."""
    check(path)
    marker = path / MARKER
    try:
        path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            fd = os.open(marker, os.O_RDWR)
            created = False
    except OSError as exc:
        raise RunFolderError(f"{path}: {exc.strerror or exc}") from None
    handle = os.fdopen(fd, "r+b")
    try:
        _lock(handle, path)
        others = [entry for entry in path.iterdir() if entry.name != MARKER]
        if created and others:
            # Something came in since the check: the user's, not ours to empty.
            marker.unlink()
            raise _not_ours(path)
        for entry in others:
            _remove(entry)
        handle.truncate(0)
        handle.write(MARKER_TEXT.encode())
        handle.flush()
    except OSError as exc:
        handle.close()
        raise RunFolderError(f"{path}: could not empty it: {exc}") from None
    except BaseException:
        handle.close()
        raise
    return handle


def job_entries(path: Path, entries: Iterable[str]) -> list[str]:
    """Which of `entries` (what a previous job of bootstrap left) are in `path`, to be
    removed: refused (RunFolderError) when some are and no marker says a run of ours
    wrote them. Changes nothing."""
    found = [name for name in entries if (path / name).exists() or (path / name).is_symlink()]
    ours = (path / JOB_MARKER).is_file() or (path / MARKER).is_file()
    if found and not ours:
        raise RunFolderError(
            f"{path} holds {', '.join(found)} that no bootstrap wrote (no {JOB_MARKER} in "
            "it); each bootstrap removes them, so give another folder or remove them yourself"
        )
    return found


def clear_job_entries(path: Path, entries: Iterable[str]) -> None:
    """Remove what a previous job left in `path` (see `job_entries`), and mark the folder
    so that the next bootstrap may remove what this one writes."""
    for name in job_entries(path, entries):
        _remove(path / name)
    marker = path / JOB_MARKER
    if not marker.is_file():
        marker.write_text(JOB_MARKER_TEXT)
