"""Turns the bearer token of a host monitor's request into the node it may speak for.

Three kinds of token are taken, as `agent_auth` allows (docs/security.md, "Agent identity"):

- `shared`: the one `agent_token` of every host monitor; it may speak for any node.
- `node_key`: `node.<node>.<mac>` (node_keys.py); it speaks for that node only.
- `kubernetes`: the pod's projected service account token, bound to `agent_kube_audience`;
  a `TokenReviewer` (supervisor/kube/token_review.py) asks the API server who it is. It
  must be the host monitors' service account, and speaks for the node the token was
  issued on (the review's `authentication.kubernetes.io/node-name`).

A heartbeat relay's request (a batch of host monitors' heartbeats, each with the node's
own credential) is carried by any host monitor's credential, or by a token of the relays'
own service account (`agent_kube_relay_service_account`): `authenticate_carrier`. Such a
token speaks for no node: `authenticate` refuses it, so a relay cannot heartbeat, report
or fetch for any node, only carry what the nodes themselves signed.

Heartbeats come from every node every few seconds, so what was verified is kept, keyed
by the token: `cached` is one dict lookup and a clock read. Node credentials and the
shared token stay valid while the settings do; a reviewed token is trusted for
`agent_kube_review_ttl_s`, never past its own expiry, and reviewed again after that. The
review runs in a worker thread (the client is blocking), once per token however many
requests wait for it, and a bounded number at a time; while the API server cannot
answer, a token it accepted before stays accepted until the token itself expires, so an
outage of the API server does not take every node's heartbeats with it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from hmac import compare_digest
from typing import Literal, Protocol

from supervisor.config_parts import AccessSettings
from supervisor.errors import SupervisorError
from supervisor.identity.node_keys import credential_node

log = logging.getLogger(__name__)

Via = Literal["shared", "node_key", "kubernetes", "relay"]
#: Verified tokens kept; past this, expired ones are dropped, then all if need be.
MAX_CACHED = 50_000
#: A token the API server refused is not sent to it again for this long.
REFUSED_TTL_S = 5.0
#: TokenReviews in flight at once: a burst of new tokens queues instead of flooding.
MAX_REVIEWS = 8


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request. `node`: the only node it may speak for; None: any (shared), or
    none at all (a relay's, which only `authenticate_carrier` returns)."""

    node: str | None
    via: Via
    #: Monotonic time until which the verification holds (inf: as long as the settings).
    expires: float = math.inf
    #: Monotonic time the token itself expires (reviewed tokens); inf: unknown or never.
    token_expires: float = math.inf


ANY_NODE = Principal(None, "shared")


@dataclass(frozen=True, slots=True)
class Review:
    """What the API server says of a token (a TokenReview's status)."""

    authenticated: bool
    username: str = ""
    #: The node the token was issued on (`authentication.kubernetes.io/node-name`).
    node: str | None = None
    #: The audiences of the token that the request asked for, as the server intersected them.
    audiences: tuple[str, ...] = ()
    error: str = ""


class ReviewUnavailable(SupervisorError):
    """The token could not be reviewed now (the API server did not answer): try again."""


class TokenReviewer(Protocol):
    """Asks who a service account token belongs to, for the audience it was built with."""

    async def review(self, token: str) -> Review: ...

    async def close(self) -> None: ...


class AgentAuthenticator:
    def __init__(
        self,
        settings: AccessSettings,
        reviewer: TokenReviewer | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        modes = set(settings.agent_auth)
        token = settings.agent_token if "shared" in modes else None
        self._shared = token.get_secret_value().encode() if token is not None else None
        key = settings.node_key if "node_key" in modes else None
        self._node_key = key.get_secret_value().encode() if key is not None else None
        if "kubernetes" in modes and reviewer is None:
            raise ValueError("agent_auth kubernetes needs a token reviewer")
        self._reviewer = reviewer if "kubernetes" in modes else None
        self._audience = settings.agent_kube_audience
        self._service_account = settings.agent_kube_service_account
        self._relay_account = settings.agent_kube_relay_service_account
        self._ttl_s = settings.agent_kube_review_ttl_s
        self._clock = clock
        self._cache: dict[bytes, Principal] = {}
        #: Relays' tokens, apart: no lookup of a host monitor's token ever finds one.
        self._carriers: dict[bytes, Principal] = {}
        self._refused: dict[bytes, float] = {}
        self._inflight: dict[bytes, asyncio.Future[Principal | None]] = {}
        self._reviews = asyncio.Semaphore(MAX_REVIEWS)

    @property
    def reviewer(self) -> TokenReviewer | None:
        return self._reviewer

    def cached(self, token: bytes) -> Principal | None:
        """Who `token` is, when that was verified and still holds; else None (then call
        `authenticate`)."""
        principal = self._cache.get(token)
        if principal is None or principal.expires <= self._clock():
            return None
        return principal

    async def authenticate(self, token: bytes) -> Principal | None:
        """Who `token` is; None: nobody we know. Raises ReviewUnavailable when a service
        account token cannot be reviewed now and was never accepted before."""
        principal = self.cached(token)
        if principal is not None:
            return principal
        if self._shared is not None and compare_digest(token, self._shared):
            return self._keep(token, ANY_NODE)
        if self._node_key is not None and token.startswith(b"node."):
            node = credential_node(self._node_key, token)
            return self._keep(token, Principal(node, "node_key")) if node else None
        if self._reviewer is not None and _looks_like_jwt(token):
            if self._carrier(token) is not None:
                return None  # a relay's: it speaks for no node
            reviewed = await self._reviewed(token)
            return None if reviewed is None or reviewed.via == "relay" else reviewed
        return None

    async def authenticate_carrier(self, token: bytes) -> Principal | None:
        """Who may carry a batch of other nodes' heartbeats: any host monitor's credential
        (`authenticate`), or a relay's token (a Principal `via` "relay", of no node)."""
        carrier = self._carrier(token)
        if carrier is not None:
            return carrier
        principal = await self.authenticate(token)
        return principal if principal is not None else self._carrier(token)

    def _carrier(self, token: bytes) -> Principal | None:
        carrier = self._carriers.get(token)
        return carrier if carrier is not None and carrier.expires > self._clock() else None

    async def close(self) -> None:
        if self._reviewer is not None:
            await self._reviewer.close()

    # --- service account tokens -----------------------------------------------------------

    async def _reviewed(self, token: bytes) -> Principal | None:
        refused_until = self._refused.get(token)
        if refused_until is not None and self._clock() < refused_until:
            return None
        review = self._inflight.get(token)
        if review is None:
            # A task of its own: a request that gives up (its client went away) does not
            # cancel the review the others wait for.
            review = asyncio.ensure_future(self._review(token))
            self._inflight[token] = review
            review.add_done_callback(lambda done: self._reviewed_done(token, done))
        return await asyncio.shield(review)

    def _reviewed_done(self, token: bytes, done: asyncio.Future[Principal | None]) -> None:
        self._inflight.pop(token, None)
        if not done.cancelled():
            done.exception()  # retrieved here too: every waiter may have gone

    async def _review(self, token: bytes) -> Principal | None:
        assert self._reviewer is not None
        stale = self._cache.get(token) or self._carriers.get(token)
        try:
            async with self._reviews:
                review = await self._reviewer.review(token.decode("ascii"))
        except ReviewUnavailable as exc:
            if stale is not None and self._clock() < stale.token_expires:
                log.warning("token review unavailable (%s); still trusting %s", exc, stale.node)
                return stale
            raise
        refusal = self._refusal(review)
        if refusal is not None:
            log.warning("service account token refused: %s", refusal)
            self._cache.pop(token, None)
            self._carriers.pop(token, None)
            if len(self._refused) >= MAX_CACHED:
                self._refused.clear()
            self._refused[token] = self._clock() + REFUSED_TTL_S
            return None
        now, wall = self._clock(), time.time()
        expiry = _jwt_expiry(token)
        token_expires = math.inf if expiry is None else now + (expiry - wall)
        expires = min(now + self._ttl_s, token_expires)
        if self._is_relay(review):
            return self._keep_carrier(token, Principal(None, "relay", expires, token_expires))
        assert review.node is not None  # checked by _refusal
        return self._keep(token, Principal(review.node, "kubernetes", expires, token_expires))

    def _is_relay(self, review: Review) -> bool:
        return self._relay_account is not None and review.username == self._relay_account

    def _refusal(self, review: Review) -> str | None:
        """Why a reviewed token is not a host monitor's; None when it is one."""
        if not review.authenticated:
            return review.error or "not authenticated"
        if self._audience not in review.audiences:
            return f"not bound to audience {self._audience!r} (audiences: {review.audiences})"
        if self._is_relay(review):
            return None  # a relay's token needs no node: it speaks for none
        if review.username != self._service_account:
            accepted = repr(self._service_account)
            if self._relay_account is not None:
                accepted += f" nor the relays' {self._relay_account!r}"
            return f"user {review.username!r} is not {accepted}"
        if not review.node:
            # Tokens carry their node from Kubernetes 1.30 (ServiceAccountTokenPodNodeInfo).
            return "the token names no node (authentication.kubernetes.io/node-name)"
        return None

    # --- the cache ----------------------------------------------------------------------

    def _keep(self, token: bytes, principal: Principal) -> Principal:
        if len(self._cache) >= MAX_CACHED:
            now = self._clock()
            self._cache = {t: p for t, p in self._cache.items() if p.expires > now}
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
        self._cache[token] = principal
        return principal

    def _keep_carrier(self, token: bytes, principal: Principal) -> Principal:
        if len(self._carriers) >= MAX_CACHED:  # relays are few: only a flood gets here
            self._carriers.clear()
        self._carriers[token] = principal
        return principal


def _looks_like_jwt(token: bytes) -> bool:
    return token.count(b".") == 2 and token.isascii()


def _jwt_expiry(token: bytes) -> float | None:
    """The `exp` claim (Unix time) of a JWT the API server has just accepted (so its
    claims are genuine); None when it has none."""
    try:
        payload = token.split(b".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4)))
        exp = claims.get("exp") if isinstance(claims, dict) else None
    except (ValueError, binascii.Error):
        return None
    return float(exp) if isinstance(exp, int | float) else None
