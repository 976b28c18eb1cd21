"""The peer tier as a training rank sees it: requests to its own host monitor.

The copy itself goes host monitor to host monitor (authenticated with the peer token,
which workers never hold): a rank only asks its node's host monitor to push a committed
RAM checkpoint to the partner node, to say what step of this rank the partner holds, and
to fetch that copy into this node's RAM tier. Nothing here raises because the host
monitor is absent or the peer tier is off: the answer is then "no peer copy".
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import httpx

from training.worker_client import (
    ENV_CA_FILE,
    ENV_MONITOR_URL,
    ENV_SERVER_NAME,
    ENV_TOKEN,
    ssl_context_for,
)

log = logging.getLogger(__name__)

_TIMEOUT_S = 5.0


class PeerTier:
    def __init__(
        self,
        monitor_url: str | None,
        token: str | None,
        rank: int,
        *,
        fetch_timeout_s: float,
        ca_file: str | None = None,
        server_name: str | None = None,
    ) -> None:
        """An https:// monitor is verified as the worker client does (`ca_file`, else the
        system's trust store; `server_name`, else the URL's host)."""
        self.rank = rank
        self.fetch_timeout_s = fetch_timeout_s
        self._http: httpx.Client | None = None
        self._warned: set[str] = set()
        if monitor_url:
            ssl_context = ssl_context_for(monitor_url, ca_file, server_name)
            self._http = httpx.Client(
                base_url=monitor_url.rstrip("/"),
                headers={"Authorization": f"Bearer {token}"} if token else {},
                timeout=_TIMEOUT_S,
                trust_env=False,
                verify=ssl_context if ssl_context is not None else True,
            )

    @classmethod
    def from_env(cls, rank: int, *, fetch_timeout_s: float = 300.0) -> PeerTier:
        """The worker client's variables: HOST_MONITOR_URL, HOST_MONITOR_WORKER_TOKEN,
        HOST_MONITOR_CA_FILE and HOST_MONITOR_SERVER_NAME."""
        return cls(
            os.environ.get(ENV_MONITOR_URL) or None,
            os.environ.get(ENV_TOKEN) or None,
            rank,
            fetch_timeout_s=fetch_timeout_s,
            ca_file=os.environ.get(ENV_CA_FILE) or None,
            server_name=os.environ.get(ENV_SERVER_NAME) or None,
        )

    @property
    def available(self) -> bool:
        return self._http is not None

    def replicate(self, step: int, path: Path) -> bool:
        """Ask the host monitor to push this committed directory to the partner (it
        answers at once and copies in the background)."""
        return self._call("POST", "replicate", json={"step": step, "path": str(path)}) is not None

    def newest(self) -> int | None:
        """The step of this rank the partner holds, if any."""
        body = self._call("GET", "peer")
        step = body.get("step") if isinstance(body, dict) else None
        return step if isinstance(step, int) else None

    def fetch(self, step: int, ram_root: Path) -> tuple[Path, bool] | None:
        """Fetch the partner's copy of `step` into this node's RAM tier: its directory,
        and whether the host monitor checked every file against the manifest as it
        downloaded it (False: the directory was there already)."""
        body = self._call(
            "POST",
            "fetch-peer",
            json={"step": step, "dest": str(ram_root)},
            timeout=self.fetch_timeout_s,
        )
        if isinstance(body, dict) and isinstance(body.get("path"), str):
            return Path(body["path"]), body.get("existed") is False
        return None

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    def _call(self, method: str, what: str, **kwargs: Any) -> Any | None:
        if self._http is None:
            return None
        path = f"/v1/workers/{self.rank}/checkpoints/{what}"
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self._warn(what, f"{method} {path} failed: {exc!r}")
            return None
        if response.status_code == 404:
            return None
        if response.status_code >= 300:
            self._warn(what, f"{method} {path}: HTTP {response.status_code} {response.text[:300]}")
            return None
        self._warned.discard(what)
        try:
            return response.json() if response.content else {}
        except ValueError:
            return {}

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("peer tier: %s", message)
