"""DCP's file writer, checksumming every file as it is written.

A checkpoint's manifest holds a CRC-32C per file. Summing the files after DCP wrote them
reads every byte a second time; summing the bytes as they go to the file costs only the
sum (with the CPU's crc32 instruction, a tenth of a RAM tier's write time here).
`SummingFileSystemWriter.sums` then holds (size, crc32c) per file name, which
`format.build_manifest` takes instead of reading the file again. A file this writer did
not see whole (renamed over, reopened) is simply absent, and summed from disk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import crc32c
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter


class _SummingStream:
    """A binary file open for writing that keeps the CRC-32C and size of what passed."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.crc = 0
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._file.write(view)
        # A buffered file takes everything or raises; a short raw write is summed short.
        n = len(view) if written is None else written
        self.crc = crc32c.crc32c(view[:n], self.crc)
        self.size += n
        return n

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._file, name)


class SummingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name
        with self._lock:
            self.sums.pop(name, None)
        with Path(path).open("wb") as file:
            summing = _SummingStream(cast(IO[bytes], file))
            yield summing
        with self._lock:
            self.sums[name] = (summing.size, summing.crc)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.sums.pop(Path(path).name, None)
            self.sums.pop(Path(new_path).name, None)
            if entry is not None and Path(path).parent == Path(new_path).parent:
                self.sums[Path(new_path).name] = entry


class SummingFileSystemWriter(FileSystemWriter):
    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = SummingFileSystem()

    @property
    def sums(self) -> dict[str, tuple[int, int]]:
        """(size, crc32c) of each file written whole, by name."""
        assert isinstance(self.fs, SummingFileSystem)
        return dict(self.fs.sums)
