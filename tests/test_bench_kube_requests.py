"""The kube-scale bench's reading of what the API server was asked (bench/kube_requests.py):
`/metrics` text as kube-apiserver writes it, and its JSON audit log."""

from __future__ import annotations

import json

from bench.kube_requests import (
    audited_requests,
    describe,
    first_after,
    growth,
    received_between,
    request_totals,
)


def sample(name: str, verb: str, resource: str, value: str, **more: str) -> str:
    """One line as kube-apiserver writes it (every label it sets, in its order)."""
    labels = {
        "code": more.get("code", "200"),
        "component": "apiserver",
        "dry_run": "",
        "group": "",
        "resource": resource,
        "scope": "cluster",
        "subresource": more.get("subresource", ""),
        "verb": verb,
        "version": "v1",
    }
    if name.endswith("_bucket"):
        labels["le"] = "0.005"
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{text}}} {value}"


DURATION = "apiserver_request_duration_seconds"
METRICS = "\n".join(
    [
        "# HELP apiserver_request_total [STABLE] Counter of apiserver requests.",
        "# TYPE apiserver_request_total counter",
        sample("apiserver_request_total", "LIST", "nodes", "3"),
        sample("apiserver_request_total", "PATCH", "nodes", "40", subresource="status"),
        sample("apiserver_request_total", "PATCH", "nodes", "2", subresource="status", code="409"),
        sample("apiserver_request_total", "WATCH", "pods", "1.5e+01", code="0"),
        f"# HELP {DURATION} [STABLE] Response latency distribution.",
        f"# TYPE {DURATION} histogram",
        sample(f"{DURATION}_bucket", "LIST", "nodes", "3"),
        sample(f"{DURATION}_count", "LIST", "nodes", "3"),
        "",
    ]
)
USER = "system:serviceaccount:training:rs-resiliency-supervisor"


def test_request_totals_sum_codes_by_verb_and_resource_and_ignore_other_metrics() -> None:
    assert request_totals(METRICS) == {
        ("list", "nodes"): 3.0,
        ("patch", "nodes/status"): 42.0,
        ("watch", "pods"): 15.0,
    }


def test_growth_counts_only_what_grew_a_pair_new_from_zero() -> None:
    before = {("list", "nodes"): 3.0, ("patch", "nodes/status"): 42.0}
    after = {("list", "nodes"): 3.0, ("patch", "nodes/status"): 50.0, ("get", "leases"): 2.0}
    assert growth(before, after) == {("patch", "nodes/status"): 8, ("get", "leases"): 2}


def audit(audit_id: str, stage: str, verb: str, resource: str, received: str, **more: str) -> str:
    ref = {"resource": resource, "namespace": "default"}
    if "name" in more:
        ref["name"] = more["name"]
    if "subresource" in more:
        ref["subresource"] = more["subresource"]
    return json.dumps(
        {
            "kind": "Event",
            "auditID": audit_id,
            "stage": stage,
            "verb": verb,
            "user": {"username": more.get("user", USER)},
            "objectRef": ref,
            "requestReceivedTimestamp": received,
            "stageTimestamp": more.get("done", received),
        }
    )


LOG = [
    audit(
        "a",
        "ResponseComplete",
        "list",
        "nodes",
        "2026-11-30T06:00:00.000000Z",
        done="2026-11-30T06:00:00.250000Z",
    ),
    audit("w", "ResponseStarted", "watch", "nodes", "2026-11-30T06:00:00.300000Z"),
    audit("k", "ResponseComplete", "patch", "nodes", "2026-11-30T06:00:01.000000Z", user="kwok"),
    audit("g", "ResponseComplete", "get", "nodes", "2026-11-30T06:00:02.000000Z", name="n1"),
    audit("p", "ResponseComplete", "patch", "nodes", "2026-11-30T06:00:02.500000Z", name="n1"),
    audit(
        "w",
        "ResponseComplete",
        "watch",
        "nodes",
        "2026-11-30T06:00:00.300000Z",
        done="2026-11-30T06:05:00Z",
    ),
    '{"kind":"Event","auditID":"cut sh',
]
T0 = 1_796_018_400.0  # 2026-11-30T06:00:00Z


def test_audited_requests_merge_a_watchs_stages_keep_one_user_and_skip_a_cut_line() -> None:
    found = audited_requests(LOG, USER)
    assert [(r.verb, r.resource, r.name) for r in found] == [
        ("list", "nodes", ""),
        ("watch", "nodes", ""),
        ("get", "nodes", "n1"),
        ("patch", "nodes", "n1"),
    ]
    assert found[0].received == T0 and found[0].completed == T0 + 0.25
    assert found[1].completed == T0 + 300  # its end, not its start
    only_started = audited_requests(LOG[:2], USER)
    assert only_started[1].completed is None


def test_requests_in_a_window_and_the_first_after_an_instant() -> None:
    found = audited_requests(LOG, USER)
    assert received_between(found, T0 + 0.2, T0 + 2.5) == {
        ("watch", "nodes"): 1,
        ("get", "nodes"): 1,
    }
    first = first_after(found, T0 + 1.0)
    assert first is not None and (first.verb, first.name) == ("get", "n1")
    write = first_after(found, T0 + 1.0, writes_only=True)
    assert write is not None and write.verb == "patch" and write.received == T0 + 2.5
    assert first_after(found, T0 + 3.0) is None


def test_describe_puts_the_most_frequent_first() -> None:
    assert describe({}, 30.0) == "0"
    text = describe({("get", "nodes"): 1, ("watch", "pods"): 2}, 10.0)
    assert text == "3 (0.30/s): 2 watch pods, 1 get nodes"
