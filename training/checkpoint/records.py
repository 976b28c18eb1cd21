"""Small JSON records that change only by compare-and-swap: the world records of the
commit fence (commit_fence.py), kept in the durable tier itself.

`read(name)` gives the record and its version; `create(name, value)` writes one only where
there is none; `replace(name, value, version)` writes only over that version. Both raise
`Conflict` when someone else wrote first, and write nothing then.

- A bucket: one object per record; S3's `If-None-Match: *` and `If-Match: <ETag>`, GCS's
  `ifGenerationMatch` (buckets.py), each the store's own atomic check.
- A directory: a record is a folder of numbered versions (`v-<n>`), each written whole to
  a temporary file and published with `link()`, which fails when the name exists: the
  writer of version n+1 is the one whose link landed first. The newest version is the
  record; older ones are removed behind it.

`conditional` is False where the store does not do it (an S3-compatible server that
ignores the conditional headers, a filesystem without hard links): the records are then
written after a read, unguarded, and the owner says so (commit_fence.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from training.checkpoint.buckets import Bucket, Conflict

__all__ = ["BucketRecords", "Conflict", "DirectoryRecords", "Records"]

_VERSION = re.compile(r"^v-(\d{12})$")


class Records(ABC):
    #: Whether `create` and `replace` are atomic here (None: not probed yet).
    conditional: bool | None = None

    @abstractmethod
    def read(self, name: str) -> tuple[dict[str, Any], str] | None: ...

    @abstractmethod
    def create(self, name: str, value: dict[str, Any]) -> str: ...

    @abstractmethod
    def replace(self, name: str, value: dict[str, Any], version: str) -> str: ...

    @abstractmethod
    def names(self, folder: str) -> list[str]:
        """The records right under `folder` (a name ending in "/")."""

    @abstractmethod
    def probe(self) -> bool:
        """Whether the store refuses a second create of one name (sets `conditional`)."""


def _encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _decode(data: bytes, where: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise OSError(f"{where}: not a record ({exc})") from None
    if not isinstance(value, dict):
        raise OSError(f"{where}: not a record")
    return value


class BucketRecords(Records):
    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket

    def read(self, name: str) -> tuple[dict[str, Any], str] | None:
        found = self.bucket.read_versioned(name)
        if found is None:
            return None
        return _decode(found[0], f"{self.bucket.url}/{name}"), found[1]

    def create(self, name: str, value: dict[str, Any]) -> str:
        if self.conditional is False:
            if self.bucket.read_versioned(name) is not None:
                raise Conflict(f"{self.bucket.url}/{name}: exists")
            self.bucket.put_bytes(name, _encode(value))
            return ""
        return self.bucket.put_if(name, _encode(value), None)

    def replace(self, name: str, value: dict[str, Any], version: str) -> str:
        if self.conditional is False:
            self.bucket.put_bytes(name, _encode(value))
            return ""
        return self.bucket.put_if(name, _encode(value), version)

    def names(self, folder: str) -> list[str]:
        return sorted(self.bucket.list(folder).objects)

    def probe(self) -> bool:
        key = f".worlds/probe-{secrets.token_hex(8)}"
        try:
            self.bucket.put_if(key, b"{}", None)
            try:
                self.bucket.put_if(key, b"{}", None)
                self.conditional = False
            except Conflict:
                self.conditional = True
        except Exception:
            # The store rejects the conditional header itself (501 NotImplemented).
            self.conditional = False
        finally:
            with contextlib.suppress(Exception):
                self.bucket.delete([key])
        return self.conditional


class DirectoryRecords(Records):
    def __init__(self, root: Path, *, sync: bool) -> None:
        self.root = Path(root)
        self.sync = sync

    def _versions(self, name: str) -> list[int]:
        try:
            listed = os.listdir(self.root / name)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in listed if (m := _VERSION.match(n)))

    def read(self, name: str) -> tuple[dict[str, Any], str] | None:
        for _ in range(100):  # a version removed behind a newer one while we looked
            versions = self._versions(name)
            if not versions:
                return None
            path = self.root / name / f"v-{versions[-1]:012d}"
            try:
                return _decode(path.read_bytes(), str(path)), str(versions[-1])
            except FileNotFoundError:
                continue
        raise OSError(f"{self.root / name}: changing too fast to read")

    def _publish(self, name: str, value: dict[str, Any], number: int) -> str:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        temp = folder / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
        with open(temp, "wb") as f:
            f.write(_encode(value))
            if self.sync:
                f.flush()
                os.fsync(f.fileno())
        target = folder / f"v-{number:012d}"
        try:
            if self.conditional is False:
                if target.exists():
                    raise Conflict(f"{target}: exists")
                os.replace(temp, target)
            else:
                os.link(temp, target)  # EEXIST: another writer's version n landed first
        except FileExistsError as exc:
            raise Conflict(f"{target}: written meanwhile") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        if self._versions(name)[-1] != number:
            # A writer that held an old version linked a number already pruned: a newer
            # version stands, so this one never counts.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            raise Conflict(f"{self.root / name}: written meanwhile")
        if self.sync:
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for old in self._versions(name):
            if old < number - 1:  # the one before stays for a reader that just listed
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(folder / f"v-{old:012d}")
        return str(number)

    def create(self, name: str, value: dict[str, Any]) -> str:
        if self._versions(name):
            raise Conflict(f"{self.root / name}: exists")
        return self._publish(name, value, 0)

    def replace(self, name: str, value: dict[str, Any], version: str) -> str:
        versions = self._versions(name)
        if not versions or str(versions[-1]) != version:
            raise Conflict(f"{self.root / name}: not at version {version}")
        return self._publish(name, value, int(version) + 1)

    def names(self, folder: str) -> list[str]:
        try:
            listed = os.listdir(self.root / folder)
        except FileNotFoundError:
            return []
        return sorted(folder + n for n in listed if not n.startswith("."))

    def probe(self) -> bool:
        folder = self.root / ".worlds"
        folder.mkdir(parents=True, exist_ok=True)
        temp = folder / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        temp.write_bytes(b"")
        try:
            os.link(temp, f"{temp}-linked")
            os.unlink(f"{temp}-linked")
            self.conditional = True
        except OSError:
            self.conditional = False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        return self.conditional
