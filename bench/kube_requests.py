"""What a Kubernetes API server was asked, read two ways: its `/metrics`
(`apiserver_request_total`, every client, by verb and resource) and its audit log (the
requests of the users its audit policy logs, each with when it was received).

Pure functions over text, so that the bench's arithmetic is tested without a server
(tests/test_bench_kube_requests.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from prometheus_client.parser import text_string_to_metric_families

#: (verb, resource), the resource with its subresource as "nodes/status".
RequestKey = tuple[str, str]
#: Verbs that change nothing.
READS = frozenset({"get", "list", "watch"})


def _resource(resource: str, subresource: str) -> str:
    return f"{resource}/{subresource}" if subresource else resource


def request_totals(metrics: str) -> dict[RequestKey, float]:
    """`apiserver_request_total` summed by (verb, resource): the codes, groups, versions
    and scopes of one pair added together. Verbs as the server counts them (LIST,
    WATCH, PATCH...): lower-cased here, as the audit log writes them."""
    totals: dict[RequestKey, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            labels = sample.labels
            key = (
                labels.get("verb", "").lower(),
                _resource(labels.get("resource", ""), labels.get("subresource", "")),
            )
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def growth(
    before: Mapping[RequestKey, float], after: Mapping[RequestKey, float]
) -> Counter[RequestKey]:
    """Requests counted between two reads (a pair absent before counts from zero)."""
    grown: Counter[RequestKey] = Counter()
    for key, value in after.items():
        delta = round(value - before.get(key, 0.0))
        if delta > 0:
            grown[key] = delta
    return grown


@dataclass(frozen=True, slots=True)
class AuditedRequest:
    """One request as the audit log tells it (its stages merged by audit ID)."""

    verb: str
    resource: str
    name: str
    received: float  # seconds since the epoch
    completed: float | None  # None: still running when the log was read (a watch)

    @property
    def key(self) -> RequestKey:
        return (self.verb, self.resource)


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def audited_requests(lines: Iterable[str], user: str) -> list[AuditedRequest]:
    """The requests of `user` in a JSON audit log, in the order they were received. A
    line cut short (the server writing it as it is read) is skipped."""
    found: dict[str, AuditedRequest] = {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("user", {}).get("username") != user:
            continue
        ref = event.get("objectRef") or {}
        completed = (
            _epoch(event["stageTimestamp"]) if event.get("stage") == "ResponseComplete" else None
        )
        known = found.get(event["auditID"])
        found[event["auditID"]] = AuditedRequest(
            verb=event["verb"],
            resource=_resource(ref.get("resource", ""), ref.get("subresource", "")),
            name=ref.get("name", ""),
            received=_epoch(event["requestReceivedTimestamp"]),
            completed=completed if completed is not None else (known.completed if known else None),
        )
    return sorted(found.values(), key=lambda r: r.received)


def received_between(
    requests: Iterable[AuditedRequest], since: float, until: float
) -> Counter[RequestKey]:
    """How many requests of each (verb, resource) were received in [since, until)."""
    return Counter(r.key for r in requests if since <= r.received < until)


def first_after(
    requests: Iterable[AuditedRequest], since: float, *, writes_only: bool = False
) -> AuditedRequest | None:
    """The first request received at or after `since` (a write, with `writes_only`)."""
    for r in requests:
        if r.received >= since and not (writes_only and r.verb in READS):
            return r
    return None


def describe(counts: Mapping[RequestKey, int], seconds: float) -> str:
    """'12 (0.40/s): 10 watch pods, 2 get nodes': the most frequent first."""
    total = sum(counts.values())
    if total == 0:
        return "0"
    parts = ", ".join(
        f"{n} {verb} {resource}"
        for (verb, resource), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    return f"{total} ({total / seconds:.2f}/s): {parts}"
