"""Probing the peers the supervisor names (resiliency_protocol/peer_probes.py): a node cut
off from them, while the supervisor still hears it, stalls its job's collectives; the
supervisor can tell which node is cut off only from what each side says it can reach.

Every round (a heartbeat period, 1 s at least) each target's GET /healthz is tried with a
short timeout; one that failed PROBE_MISSES rounds in a row is named unreachable in the
heartbeats until it answers again. The targets are asked for again and again, at first
every second, then less often, up to every TARGETS_REFRESH_MAX_S: a cluster that is still
coming up gives a partial ring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import httpx

from host_monitor.credentials import BearerCredential, CredentialError
from resiliency_protocol.peer_probes import (
    PROBE_MISSES,
    PROBE_PERIOD_MIN_S,
    ProbeTarget,
    ProbeTargets,
)
from resiliency_protocol.tls import client_context

log = logging.getLogger(__name__)

__all__ = ["PROBE_MISSES", "PeerProbes"]

PROBE_TIMEOUT_S = 1.0
TARGETS_REFRESH_MAX_S = 60.0


class PeerProbes:
    def __init__(
        self,
        supervisor_url: str,
        credential: BearerCredential,
        node: str,
        period_s: float,
        ssl_context: ssl.SSLContext | None = None,
        peer_ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context` verifies the supervisor, `peer_ssl_context` the peers (host
        monitor certificates): a peer whose certificate cannot be checked would look cut
        off."""
        self._targets_url = f"{supervisor_url.rstrip('/')}/api/v1/nodes/{node}/probe-targets"
        self._credential = credential
        self._period_s = max(period_s, PROBE_PERIOD_MIN_S)
        self._ssl = ssl_context if ssl_context is not None else client_context()
        self._peer_ssl = peer_ssl_context if peer_ssl_context is not None else self._ssl
        self._targets: list[ProbeTarget] = []
        self._misses: dict[str, int] = {}

    def unreachable(self) -> list[str]:
        """The peers named unreachable now, sorted."""
        return sorted(n for n, misses in self._misses.items() if misses >= PROBE_MISSES)

    async def run(self) -> None:
        refresh_s, next_refresh = 1.0, 0.0
        loop = asyncio.get_running_loop()
        timeout = httpx.Timeout(PROBE_TIMEOUT_S)
        async with (
            httpx.AsyncClient(timeout=timeout, verify=self._ssl) as supervisor,
            httpx.AsyncClient(timeout=timeout, verify=self._peer_ssl) as peers,
        ):
            while True:
                started = loop.time()
                if started >= next_refresh:
                    await self._refresh(supervisor)
                    next_refresh = started + refresh_s
                    refresh_s = min(refresh_s * 2, TARGETS_REFRESH_MAX_S)
                await self.probe(peers)
                await asyncio.sleep(max(0.0, started + self._period_s - loop.time()))

    async def _refresh(self, client: httpx.AsyncClient) -> None:
        try:
            headers = {"Authorization": self._credential.header()}
            response = await client.get(self._targets_url, headers=headers)
            response.raise_for_status()
            targets = ProbeTargets.model_validate_json(response.content).peers
        except (httpx.HTTPError, CredentialError, ValueError) as exc:
            log.debug("probe targets not refreshed: %s", exc)  # the old ones serve
            return
        if [t.node for t in targets] != [t.node for t in self._targets]:
            log.info("probing peers %s", [t.node for t in targets])
        self._targets = targets
        names = {t.node for t in targets}
        self._misses = {n: m for n, m in self._misses.items() if n in names}

    async def probe(self, client: httpx.AsyncClient) -> None:
        """One round: every target tried at once."""
        targets = list(self._targets)
        answers = await asyncio.gather(*(self._answers(client, t) for t in targets))
        for target, answered in zip(targets, answers, strict=True):
            was = self._misses.get(target.node, 0)
            now = 0 if answered else was + 1
            self._misses[target.node] = now
            if now == PROBE_MISSES:
                log.warning("peer %s does not answer at %s", target.node, target.url)
            elif answered and was >= PROBE_MISSES:
                log.info("peer %s answers again", target.node)

    @staticmethod
    async def _answers(client: httpx.AsyncClient, target: ProbeTarget) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            response = await client.get(f"{target.url.rstrip('/')}/healthz")
            return response.status_code < 500
        return False
