"""A worker's fetch of the partner's copy of its rank into its node's RAM tier.

A worker on a swapped-in spare (empty RAM) asks its host monitor for the partner's copy
of its rank at a step: every file is downloaded at once, verified against the manifest
as it arrives, into a temporary directory under `<dest>/step-<step>/`, renamed to
`rank-<rank>` once complete. The files are given to the owner of `dest` (the worker's
user), so that the worker can delete them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
import uuid
from pathlib import Path

import httpx

from host_monitor.peer.client import PartnerClient
from host_monitor.peer.files import rank_dir_name, step_dir_name, write_all
from host_monitor.peer.paths import (
    O_DIR,
    O_NEW,
    O_OVERWRITE,
    PeerTierError,
    committed,
    give_to,
    open_dir_under,
    owner_of,
    remove_dir,
)
from resiliency_protocol.checkpoint_manifest import MANIFEST
from resiliency_protocol.node_commands import CheckpointPeer
from resiliency_protocol.peer_checkpoints import FetchPeerRequest, FetchPeerResult

log = logging.getLogger(__name__)


class Fetch:
    """One fetch: of `rank`'s copy at `req.step` from `peer`, for job segment `job`."""

    def __init__(
        self,
        client: PartnerClient,
        peer: CheckpointPeer,
        http: httpx.AsyncClient,
        job: str,
        rank: int,
        req: FetchPeerRequest,
    ) -> None:
        self.client = client
        self.peer = peer
        self.http = http
        self.job = job
        self.rank = rank
        self.req = req
        self.started = time.monotonic()

    async def run(self, checkpoint_root: Path) -> FetchPeerResult:
        """Into `<dest>/step-<step>/rank-<rank>/` (temporary directory, verified, renamed)."""
        req, rank = self.req, self.rank
        step_name, rank_name = step_dir_name(req.step), rank_dir_name(rank)
        dest_fd, dest = open_dir_under(checkpoint_root, req.dest, "dest", create=True)
        path = dest / step_name / rank_name
        owner = owner_of(dest_fd)
        made_step_dir = False
        done = False
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(step_name, 0o755, dir_fd=dest_fd)
                made_step_dir = True
                give_to(step_name, dest_fd, owner)
            try:
                step_fd = os.open(step_name, O_DIR, dir_fd=dest_fd)
            except OSError as exc:
                raise PeerTierError(422, "dest", f"{dest / step_name}: {exc.strerror}") from None
            try:
                if committed(step_fd, rank_name):
                    done = True
                    return self._result(path, 0, existed=True)
                try:
                    size = await self._into(step_fd, owner)
                except OSError as exc:  # e.g. the RAM tier is full
                    code = 507 if exc.errno == errno.ENOSPC else 500
                    raise PeerTierError(code, "dest", f"{path}: {exc.strerror or exc}") from None
                done = True
                if size is None:  # another fetch committed it meanwhile
                    return self._result(path, 0, existed=True)
                log.info(
                    "rank %d step %d restored from partner %s into %s (%d bytes)",
                    rank,
                    req.step,
                    self.peer.node,
                    path,
                    size,
                )
                return self._result(path, size, existed=False)
            finally:
                os.close(step_fd)
        finally:
            if made_step_dir and not done:
                with contextlib.suppress(OSError):  # only if still empty
                    os.rmdir(step_name, dir_fd=dest_fd)
            os.close(dest_fd)

    def _result(self, path: Path, size: int, *, existed: bool) -> FetchPeerResult:
        seconds = round(time.monotonic() - self.started, 3)
        return FetchPeerResult(
            step=self.req.step, path=str(path), bytes=size, seconds=seconds, existed=existed
        )

    async def _into(self, step_fd: int, owner: tuple[int, int] | None) -> int | None:
        """Download into a temporary directory of `step_fd`, renamed to rank-<rank> once
        complete: the bytes downloaded, None when rank-<rank> was committed meanwhile."""
        peer, rank, step = self.peer, self.rank, self.req.step
        newest = await self.client.lookup(peer, self.http, self.job, rank)
        copy = newest.by_step(step)
        if copy is None:
            kept = [c.step for c in (newest, *newest.older)]
            raise PeerTierError(
                404, "step", f"partner {peer.node} keeps steps {kept} of rank {rank}, not {step}"
            )
        rank_name = rank_dir_name(rank)
        tmp_name = f".{rank_name}.tmp-{uuid.uuid4().hex[:12]}"
        os.mkdir(tmp_name, 0o755, dir_fd=step_fd)
        renamed = False
        try:
            give_to(tmp_name, step_fd, owner)
            tmp_fd = os.open(tmp_name, O_DIR, dir_fd=step_fd)
            try:
                files = sorted(copy.manifest.files.items())
                checksum = copy.manifest.checksum

                def opener(name: str) -> int:
                    return os.open(name, O_OVERWRITE, 0o644, dir_fd=tmp_fd)

                # The files at once, each in a thread of the client's pool.
                await asyncio.gather(
                    *(
                        self.client.download(
                            peer,
                            self.http,
                            self.job,
                            rank,
                            step,
                            name,
                            lambda name=name: opener(name),  # type: ignore[misc]
                            entry,
                            checksum,
                        )
                        for name, entry in files
                    )
                )
                for name, _ in files:
                    give_to(name, tmp_fd, owner)
                size = sum(e.size for _, e in files)
                fd = os.open(MANIFEST, O_NEW, 0o644, dir_fd=tmp_fd)
                try:
                    write_all(fd, copy.manifest.model_dump_json(indent=1).encode())
                finally:
                    os.close(fd)
                give_to(MANIFEST, tmp_fd, owner)
            finally:
                os.close(tmp_fd)
            try:
                os.rename(tmp_name, rank_name, src_dir_fd=step_fd, dst_dir_fd=step_fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if not committed(step_fd, rank_name):
                    raise PeerTierError(
                        409, "dest", f"{rank_name} of step {step} exists, not committed"
                    ) from None
                return None
            renamed = True
            return size
        finally:
            if not renamed:
                await asyncio.to_thread(remove_dir, tmp_name, step_fd)
