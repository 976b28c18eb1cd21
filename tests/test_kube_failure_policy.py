"""Reading a JobSet's spec for what an eviction of its pods leads to (the choice between
a workload restart by eviction and one by recreated Jobs), and which Jobs an in-process
heal recreates, on the shapes users write."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from supervisor.kube.failure_policy import (
    eviction_restart_refusal,
    job_failure_reason,
    jobset_action,
)
from supervisor.kube.in_process import one_pod_at_a_time, recreated_replicated_jobs
from tests.kube.harness import jobset

FAIL_ON_DISRUPTION = {
    "action": "FailJob",
    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
}


def job_spec(js: dict[str, Any], i: int = 0) -> dict[str, Any]:
    spec: dict[str, Any] = js["spec"]["replicatedJobs"][i]["template"]["spec"]
    return spec


def test_the_readme_policy_restarts_by_eviction() -> None:
    assert eviction_restart_refusal(jobset()) is None


@pytest.mark.parametrize(
    ("pod_failure_policy", "backoff_limit", "reason"),
    [
        ({"rules": [FAIL_ON_DISRUPTION]}, 3, "PodFailurePolicy"),
        # The status defaults to True; conditions of other types do not match.
        (
            {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "ConfigIssue"}]},
                    {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
                ]
            },
            3,
            "PodFailurePolicy",
        ),
        (None, 0, "BackoffLimitExceeded"),
        ({"rules": [{**FAIL_ON_DISRUPTION, "action": "Count"}]}, 0, "BackoffLimitExceeded"),
        (None, 6, None),
        ({"rules": [{**FAIL_ON_DISRUPTION, "action": "Ignore"}]}, 0, None),
        # A rule on exit codes first: what the worker answers SIGTERM with decides.
        (
            {
                "rules": [
                    {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [143]}},
                    FAIL_ON_DISRUPTION,
                ]
            },
            0,
            None,
        ),
    ],
)
def test_job_failure_reason(
    pod_failure_policy: dict[str, Any] | None, backoff_limit: int, reason: str | None
) -> None:
    spec: dict[str, Any] = {"backoffLimit": backoff_limit}
    if pod_failure_policy is not None:
        spec["podFailurePolicy"] = pod_failure_policy
    got, why = job_failure_reason(spec)
    assert got == reason
    assert bool(why) == (reason is None)


def test_backoff_limit_defaults_to_six() -> None:
    assert job_failure_reason({})[0] is None


def test_jobset_action_first_matching_rule_else_restart() -> None:
    policy = {
        "maxRestarts": 2,
        "rules": [
            {"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
             "targetReplicatedJobs": ["driver"]},
            {"action": "RestartJobSetAndIgnoreMaxRestarts",
             "onJobFailureReasons": ["PodFailurePolicy"]},
        ],
    }  # fmt: skip
    assert jobset_action(policy, "driver", "PodFailurePolicy") == "FailJobSet"
    assert jobset_action(policy, "workers", "PodFailurePolicy") == (
        "RestartJobSetAndIgnoreMaxRestarts"
    )
    assert jobset_action(policy, "workers", "BackoffLimitExceeded") == "RestartJobSet"
    # A rule without reasons matches every reason.
    assert jobset_action({"rules": [{"action": "FailJobSet"}]}, "w", "X") == "FailJobSet"
    # No failurePolicy: maxRestarts 0, the first failed Job fails the JobSet.
    assert jobset_action(None, "workers", "PodFailurePolicy") == "FailJobSet"


def test_refusals_name_the_replicated_job_and_the_reason() -> None:
    counted = jobset(failure_policy={"maxRestarts": 3})
    assert eviction_restart_refusal(counted) == (
        "replicatedJob workers: a Job failing with PodFailurePolicy gets RestartJobSet, "
        "not RestartJobSetAndIgnoreMaxRestarts"
    )
    no_policy = jobset()
    del no_policy["spec"]["failurePolicy"]
    assert "gets FailJobSet" in (eviction_restart_refusal(no_policy) or "")
    retried = jobset()
    del job_spec(retried)["podFailurePolicy"]
    job_spec(retried)["backoffLimit"] = 4
    assert "an evicted pod is recreated" in (eviction_restart_refusal(retried) or "")
    # Every replicated Job must restart the JobSet, not only the first.
    mixed = jobset()
    second = copy.deepcopy(mixed["spec"]["replicatedJobs"][0])
    second["name"] = "driver"
    second["template"]["spec"]["backoffLimit"] = 4
    del second["template"]["spec"]["podFailurePolicy"]
    mixed["spec"]["replicatedJobs"].append(second)
    assert (eviction_restart_refusal(mixed) or "").startswith("replicatedJob driver:")


def test_the_jobs_recreated_by_an_in_process_heal() -> None:
    """A heal recreates a replaced pod's Job (for a new pod without the Job controller's
    pod-failure backoff) only where the JobSet controller creates a missing Job again at
    once, and only a Job of one pod at a time; elsewhere the Job replaces the pod."""
    js = jobset()
    js["spec"]["replicatedJobs"].append(
        {"name": "after", "dependsOn": [{"name": "workers", "status": "Ready"}]}
    )
    assert recreated_replicated_jobs(js) == {o["name"] for o in js["spec"]["replicatedJobs"][:-1]}
    in_order = copy.deepcopy(js)
    in_order["spec"]["startupPolicy"] = {"startupPolicyOrder": "InOrder"}
    assert recreated_replicated_jobs(in_order) == set()
    any_order = copy.deepcopy(js)
    any_order["spec"]["startupPolicy"] = {"startupPolicyOrder": "AnyOrder"}
    assert recreated_replicated_jobs(any_order) == recreated_replicated_jobs(js)
    assert one_pod_at_a_time({"spec": {}})
    assert one_pod_at_a_time({"spec": {"parallelism": 1, "completions": 1}})
    assert not one_pod_at_a_time({"spec": {"parallelism": 2, "completions": 2}})
    assert not one_pod_at_a_time({"spec": {"parallelism": 1, "completions": 4}})
