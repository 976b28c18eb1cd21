"""Loads a rank's checkpoint straight into the model's and optimizer's own tensors.

torch.distributed.checkpoint's FileSystemReader deserializes each tensor into a new one
(`torch.load` of the item) and then copies it into the target: two copies of every byte
and a fresh allocation of the whole state per load. Each tensor item DCP writes is a
`torch.save` archive whose storage is one uncompressed record; when the target tensor is
contiguous, on the CPU, and the record holds exactly its bytes (same dtype, shape and a
contiguous layout, read from the archive's pickle without touching the data), this
reader reads the record's bytes from the file directly into the target. Anything else
(narrowed reads of resharded tensors, other layouts, a torch whose reader differs) takes
DCP's own path, item by item.

Given the manifest, the reader also checks each file's checksum as it reads it: the bytes
read into a tensor are summed while they are still in the CPU's cache, and the bytes
between them (archive headers, items left to DCP's path) are read and summed in file
order, so a file is read once rather than once to verify and once to load. A file whose
sum disagrees is listed in `corrupt` (the caller drops what was loaded); files the load
never opened are left out of `summed`, for the caller to verify on their own.
"""

from __future__ import annotations

import ctypes
import io
import os
import struct
import sys
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from resiliency_protocol.checkpoint_manifest import Checksum

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header, 30 bytes
#: Bytes read into a tensor at a time, then summed while still in the CPU's cache.
_CHUNK = 4 * 1024 * 1024


class _FileSum:
    """The checksum of one file, fed in file order: bytes already read by the loader are
    summed from memory, the gaps between them read here."""

    def __init__(self, fd: int, checksum: Checksum) -> None:
        self.fd, self.pos, self.crc = fd, 0, 0
        self.checksum = checksum
        self.in_order = True

    def upto(self, offset: int) -> None:
        while self.pos < offset:
            chunk = os.pread(self.fd, min(_CHUNK, offset - self.pos), self.pos)
            if not chunk:
                return  # the file is shorter: the size check says so
            self.crc = self.checksum(chunk, self.crc)
            self.pos += len(chunk)

    def add(self, offset: int, data: memoryview) -> None:
        if not self.in_order:
            return
        self.upto(offset)
        if offset != self.pos:  # overlapping reads: summed again from disk at the end
            self.in_order = False
            return
        self.crc = self.checksum(data, self.crc)
        self.pos += len(data)


class _Window(io.RawIOBase):
    """A read-only view of bytes [offset, offset + length) of an open file."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        self._f, self._start, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n]) or 0
        self._pos += got
        return got


class DirectReader(FileSystemReader):
    #: Items read straight into their target, and the others, in this process (tests).
    direct = 0
    fallback = 0

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int = 1,
        sums: dict[str, tuple[int, int]] | None = None,
        checksum: Checksum | None = None,
    ) -> None:
        """`sums`: (size, checksum) by file path relative to `path`, to check each file
        with `checksum` (the manifest's) as it is read."""
        super().__init__(path)
        self.thread_count = thread_count
        self.sums = sums or {}
        self.checksum = checksum
        #: Files checked as they were read, and those of them whose sum disagreed.
        self.summed: set[str] = set()
        self.corrupt: list[str] = []
        #: Files the load read from (relative paths): of a view, the ranks it needed.
        self.opened: set[str] = set()
        self._lock = threading.Lock()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage = getattr(self, "storage_data", None)
        if not isinstance(storage, dict) or sys.byteorder != "little":
            return super().read_data(plan, planner)
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(storage[item.storage_index].relative_path, []).append(item)
        self.opened.update(per_file)

        def read_file(relative_path: str, items: list[Any]) -> list[Any]:
            """This file's items read straight into their targets; the others."""
            left = []
            expected = self.sums.get(relative_path)
            with open(os.path.join(self.path, relative_path), "rb") as f:
                summer = (
                    _FileSum(f.fileno(), self.checksum)
                    if expected is not None and self.checksum is not None
                    else None
                )
                for item in sorted(items, key=lambda i: storage[i.storage_index].offset):
                    info = storage[item.storage_index]
                    if (
                        item.type != LoadItemType.BYTE_IO
                        and not getattr(info, "transform_descriptors", None)
                        and self._read_into(f, info.offset, info.length, item, planner, summer)
                    ):
                        continue
                    left.append(item)
                if summer is not None and expected is not None:
                    self._check(relative_path, summer, expected)
            return left

        # The files at once (DCP writes one per writer thread): readinto releases the GIL.
        with ThreadPoolExecutor(max(1, min(self.thread_count, len(per_file)))) as pool:
            lefts = list(pool.map(lambda kv: read_file(*kv), per_file.items()))
        rest = [item for left in lefts for item in left]
        DirectReader.direct += len(plan.items) - len(rest)
        if rest:
            DirectReader.fallback += len(rest)
            return super().read_data(LoadPlan(rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _check(self, relative_path: str, summer: _FileSum, expected: tuple[int, int]) -> None:
        size, crc = expected
        summer.upto(size)
        if not summer.in_order:
            return  # not summed: the caller verifies this file from disk
        with self._lock:
            self.summed.add(relative_path)
            if (summer.pos, summer.crc) != (size, crc) or os.fstat(summer.fd).st_size != size:
                self.corrupt.append(
                    f"{os.path.join(self.path, relative_path)}: checksum {summer.crc:#010x} of "
                    f"{summer.pos} bytes, manifest says {crc:#010x} of {size}"
                )

    @staticmethod
    def _read_into(
        f: io.BufferedReader,
        offset: int,
        length: int,
        item: Any,
        planner: LoadPlanner,
        summer: _FileSum | None = None,
    ) -> bool:
        target = planner.resolve_tensor(item).detach()
        if (
            target.device.type != "cpu"
            or not target.is_contiguous()
            or target.dim() == 0
            or any(o != 0 for o in item.storage_offsets)
            or list(item.lengths) != list(target.shape)
        ):
            return False
        window = _Window(f, offset, length)
        try:
            meta = torch.load(cast(IO[bytes], window), map_location="meta", weights_only=True)
            window.seek(0)
            with zipfile.ZipFile(window) as archive:
                records = [i for i in archive.infolist() if "/data/" in i.filename]
        except Exception:  # a damaged or foreign header: DCP's own path reports it
            return False
        nbytes = target.numel() * target.element_size()
        if (
            not isinstance(meta, torch.Tensor)
            or meta.dtype != target.dtype
            or meta.shape != target.shape
            or meta.storage_offset() != 0
            or not meta.is_contiguous()
            or len(records) != 1
            or records[0].compress_type != zipfile.ZIP_STORED
            or records[0].file_size != nbytes
        ):
            return False
        record = records[0]
        f.seek(offset + record.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            return False
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != b"PK\x03\x04":
            return False
        data = offset + record.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if data + nbytes > offset + length:
            return False
        # The target's own memory, as a writable buffer (no copy, and no numpy needed).
        view = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
        f.seek(data)
        done = 0
        while done < nbytes:
            got = f.readinto(view[done : done + _CHUNK])
            if not got:
                raise OSError(f"{f.name}: ends inside a tensor record")
            if summer is not None:
                summer.add(data + done, view[done : done + got])
            done += got
        planner.commit_tensor(item, target)
        return True
