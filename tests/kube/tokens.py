"""Service account tokens: issued as the kubelet gets them for a projected volume
(TokenRequest), and reviewed as `POST /apis/authentication.k8s.io/v1/tokenreviews` does.

Tokens are JWTs with the claims a real kube-apiserver puts in a bound token
(`pkg/serviceaccount/claims.go`): `iss`, `aud`, `sub`
(`system:serviceaccount:<ns>:<name>`), `exp`/`iat`/`nbf`, `jti`, and the private
`kubernetes.io` claim naming the namespace, the service account and, for a token bound to
a pod, the pod and its node. They are signed with HS256 under a key of the fake (the real
server signs with RS256 or ES256 under its service account key: only the issuer can
check either).

A review (`pkg/registry/authentication/tokenreview`) answers 201 with the TokenReview:
`status.authenticated` true with `user` (username, uid, groups, and `extra` with the
pod's name and uid, the node's name and uid, and the credential id, as 1.32 does) and
`status.audiences` (the token's audiences that the review asked for); or no
`authenticated`, an empty `user` and `status.error` saying why: a bad signature or
shape, an expired token, audiences that do not meet the review's, or a bound pod that is
gone or was replaced (another UID). A review without `spec.token` is 400. A review
without `spec.audiences` checks the server's own audience (API_AUDIENCE).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
import uuid
from typing import Any

from .resources import ApiError, Obj

ISSUER = "https://kubernetes.default.svc.cluster.local"
#: The API server's own audience (--api-audiences; by default the issuer).
API_AUDIENCE = ISSUER
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"
NODE_NAME = "authentication.kubernetes.io/node-name"
NODE_UID = "authentication.kubernetes.io/node-uid"
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"


class TokenIssuer:
    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)
        # Service accounts have UIDs; the fake keeps one per name (no ServiceAccount objects).
        self._sa_uids: dict[tuple[str, str], str] = {}

    def issue(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: list[str],
        pod: Obj | None = None,
        node: Obj | None = None,
        expiration_seconds: int = 3600,
        now: float | None = None,
    ) -> str:
        """A token for the service account, bound to `pod` (on `node`) when given."""
        issued = int(time.time() if now is None else now)
        sa_uid = self._sa_uid(namespace, service_account)
        private: Obj = {
            "namespace": namespace,
            "serviceaccount": {"name": service_account, "uid": sa_uid},
        }
        if pod is not None:
            private["pod"] = {"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        if node is not None:
            private["node"] = {"name": node["metadata"]["name"], "uid": node["metadata"]["uid"]}
        claims = {
            "aud": audiences,
            "exp": issued + expiration_seconds,
            "iat": issued,
            "iss": ISSUER,
            "jti": str(uuid.uuid4()),
            "kubernetes.io": private,
            "nbf": issued,
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
        }
        header = _b64(json.dumps({"alg": "HS256", "kid": "fake"}).encode())
        payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{header}.{payload}.{self._sign(header, payload)}"

    def review(self, body: Any, get_pod: Any) -> Obj:
        """The TokenReview answered for `body`; `get_pod(namespace, name)` reads a pod."""
        spec = (body.get("spec") if isinstance(body, dict) else None) or {}
        token = spec.get("token") or ""
        if not token:
            raise ApiError(400, "BadRequest", "token is required for TokenReview in authentication")
        requested = list(spec.get("audiences") or [])
        out: Obj = {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": {"token": token, **({"audiences": requested} if requested else {})},
        }
        try:
            claims = self._claims(token)
            status = self._authenticated(claims, requested or [API_AUDIENCE], get_pod)
        except _Invalid as exc:
            status = {"user": {}, "error": f"[invalid bearer token, {exc}]"}
        out["status"] = status
        return out

    # --- checks -------------------------------------------------------------------------

    def _claims(self, token: str) -> Obj:
        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(self._sign(parts[0], parts[1]), parts[2]):
            raise _Invalid("square/go-jose: error in cryptographic primitive")
        payload = parts[1] + "=" * (-len(parts[1]) % 4)
        try:
            claims: Obj = json.loads(base64.urlsafe_b64decode(payload))
        except ValueError:
            raise _Invalid("square/go-jose: error in cryptographic primitive") from None
        return claims

    def _authenticated(self, claims: Obj, requested: list[str], get_pod: Any) -> Obj:
        now = time.time()
        if claims["exp"] <= now:
            raise _Invalid("service account token has expired")
        if claims["nbf"] > now:
            raise _Invalid("service account token is not valid yet")
        token_audiences = list(claims.get("aud") or [])
        audiences = [a for a in token_audiences if a in requested]
        if not audiences:
            raise _Invalid(
                f"token audiences {json.dumps(token_audiences)} is invalid for the target "
                f"audiences {json.dumps(requested)}"
            )
        private = claims["kubernetes.io"]
        namespace, sa = private["namespace"], private["serviceaccount"]
        extra: dict[str, list[str]] = {CREDENTIAL_ID: [f"JTI={claims['jti']}"]}
        pod_ref = private.get("pod")
        if pod_ref is not None:
            pod = get_pod(namespace, pod_ref["name"])
            if pod is None:
                raise _Invalid("service account token has been invalidated")
            if pod["metadata"]["uid"] != pod_ref["uid"]:
                raise _Invalid(
                    f"pod UID ({pod['metadata']['uid']}) does not match service account "
                    f"claim ({pod_ref['uid']})"
                )
            extra[POD_NAME] = [pod_ref["name"]]
            extra[POD_UID] = [pod_ref["uid"]]
        node_ref = private.get("node")
        if node_ref is not None:
            extra[NODE_NAME] = [node_ref["name"]]
            extra[NODE_UID] = [node_ref["uid"]]
        return {
            "authenticated": True,
            "user": {
                "username": claims["sub"],
                "uid": sa["uid"],
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{namespace}",
                    "system:authenticated",
                ],
                "extra": extra,
            },
            "audiences": audiences,
        }

    def _sign(self, header: str, payload: str) -> str:
        mac = hmac.new(self._key, f"{header}.{payload}".encode(), hashlib.sha256).digest()
        return _b64(mac)

    def _sa_uid(self, namespace: str, name: str) -> str:
        return self._sa_uids.setdefault((namespace, name), str(uuid.uuid4()))


class _Invalid(Exception):
    """Why a token does not authenticate (the real server's wording)."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
