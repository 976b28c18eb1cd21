"""Directories workers name to the peer tier, opened safely, and the tier's error.

Workers may only name directories under `checkpoint_root` (symlinks resolved, and the
directory actually opened checked again): the host monitor may run as root, and must
not read or write anything else for them. Files are opened relative to directory fds
with O_NOFOLLOW, and what the host monitor creates for a worker is given to its owner.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from host_monitor.errors import HostMonitorError
from host_monitor.peer.files import MAX_MANIFEST_BYTES
from resiliency_protocol.checkpoint_manifest import MANIFEST, Manifest

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
O_OVERWRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class PeerTierError(HostMonitorError):
    """A worker's request that cannot be served: HTTP `status`, `field` names why."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.status = status
        self.field = field
        self.message = message


def opened_path(fd: int) -> Path:
    """Where an open directory really is (after any symlink swap)."""
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


def open_dir_under(root: Path, path: str, field: str, *, create: bool = False) -> tuple[int, Path]:
    """Open the directory `path`, which must lie under `root` once symlinks are resolved:
    (fd, real path). 403 outside; 422 when not a directory (404 when missing)."""
    given = Path(path)
    if not given.is_absolute():
        raise PeerTierError(422, field, f"{path!r} is not an absolute path")
    real_root = root.resolve()
    outside = PeerTierError(403, field, f"{path} is outside checkpoint_root {root}")
    resolved = given.resolve()
    if not resolved.is_relative_to(real_root):
        raise outside
    if create:
        try:
            resolved.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PeerTierError(422, field, f"cannot create {path}: {exc.strerror}") from None
    try:
        fd = os.open(resolved, O_DIR)
    except FileNotFoundError:
        raise PeerTierError(404, field, f"{path}: no such directory") from None
    except OSError as exc:
        raise PeerTierError(422, field, f"{path}: {exc.strerror or exc}") from None
    real = opened_path(fd)
    if not real.is_relative_to(real_root):  # a component was swapped for a symlink
        os.close(fd)
        raise outside
    return fd, real


def owner_of(dir_fd: int) -> tuple[int, int] | None:
    """Files we create in a worker's directory get its owner when we run as root, so the
    worker can delete them."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(dir_fd)
    return st.st_uid, st.st_gid


def give_to(name: str, dir_fd: int, owner: tuple[int, int] | None) -> None:
    if owner is not None:
        os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)


def read_dir_manifest(dir_fd: int, field: str) -> Manifest:
    try:
        fd = os.open(MANIFEST, O_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        raise PeerTierError(422, field, f"no {MANIFEST}: not a committed checkpoint") from None
    try:
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return Manifest.parse(data)
    except ValueError as exc:
        raise PeerTierError(422, field, str(exc)) from None


def committed(dir_fd: int, name: str) -> bool:
    try:
        os.stat(f"{name}/{MANIFEST}", dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def remove_dir(name: str, dir_fd: int) -> None:
    shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
