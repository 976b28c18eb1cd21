"""What the Job and JobSet controllers will do when the supervisor evicts a JobSet's
pods, read from the JobSet's spec: restart the whole JobSet without using up
`maxRestarts`, or something else.

A workload restart is best done that way: the JobSet controller then restarts the
JobSet as after any failure, so `status.restarts` and the `restart-attempt` label of
the new Jobs and pods go up, and workers that key their rendezvous or collective state
on that label start afresh. It takes the failure policy of docs/kubernetes.md ("JobSet
requirements"); a JobSet without it is restarted by deleting its child Jobs instead.

Only what can be known in advance counts: a pod failure policy rule on exit codes
(which a worker's answer to SIGTERM decides) makes the outcome unknowable, so such a
JobSet is not restarted by eviction.
"""

from __future__ import annotations

from typing import Any

from supervisor.kube.objects import Obj

DISRUPTION_TARGET = "DisruptionTarget"
IGNORE_MAX_RESTARTS = "RestartJobSetAndIgnoreMaxRestarts"


def job_failure_reason(job_spec: Obj) -> tuple[str | None, str]:
    """The reason a Job of this spec fails for when one of its pods is evicted (marked
    DisruptionTarget), or None with why it may not fail."""
    for i, rule in enumerate((job_spec.get("podFailurePolicy") or {}).get("rules") or []):
        if rule.get("onExitCodes"):
            return None, f"podFailurePolicy rule {i} matches exit codes: the outcome is unknown"
        conditions = rule.get("onPodConditions") or []
        if not any(
            c.get("type") == DISRUPTION_TARGET and c.get("status", "True") == "True"
            for c in conditions
        ):
            continue
        action = rule.get("action")
        if action == "FailJob":
            return "PodFailurePolicy", ""
        if action == "Count":
            break  # counted against backoffLimit, as with no rule
        return None, f"podFailurePolicy rule {i} answers {DISRUPTION_TARGET} with {action}"
    if int(job_spec.get("backoffLimit", 6)) == 0:
        return "BackoffLimitExceeded", ""
    return None, "an evicted pod is recreated (backoffLimit > 0, no FailJob on DisruptionTarget)"


def jobset_action(failure_policy: Obj | None, replicated_job: str, reason: str) -> str:
    """The JobSet controller's answer to a Job of `replicated_job` failing for `reason`:
    the first matching rule's action; with none matching, RestartJobSet."""
    if failure_policy is None:
        return "FailJobSet"  # no failurePolicy: maxRestarts 0, the first failure is final
    for rule in failure_policy.get("rules") or []:
        reasons = rule.get("onJobFailureReasons") or []
        targets = rule.get("targetReplicatedJobs") or []
        if (not reasons or reason in reasons) and (not targets or replicated_job in targets):
            return str(rule.get("action", "RestartJobSet"))
    return "RestartJobSet"


def eviction_restart_refusal(js: Obj) -> str | None:
    """None when evicting the JobSet's pods restarts it without counting toward
    `maxRestarts`; else why not, in words."""
    spec: dict[str, Any] = js.get("spec") or {}
    policy = spec.get("failurePolicy")
    for rjob in spec.get("replicatedJobs") or []:
        name = str(rjob.get("name"))
        job_spec = (rjob.get("template") or {}).get("spec") or {}
        reason, why = job_failure_reason(job_spec)
        if reason is None:
            return f"replicatedJob {name}: {why}"
        action = jobset_action(policy, name, reason)
        if action != IGNORE_MAX_RESTARTS:
            return (
                f"replicatedJob {name}: a Job failing with {reason} gets {action}, "
                f"not {IGNORE_MAX_RESTARTS}"
            )
    return None


def in_process_refusal(js: Obj) -> str | None:
    """None when a lost pod of the JobSet is replaced by its Job alone, the others left
    running (what an in-process heal needs): each Job answers an evicted pod
    (DisruptionTarget) with `Ignore`. Else why not, in words."""
    spec: dict[str, Any] = js.get("spec") or {}
    for rjob in spec.get("replicatedJobs") or []:
        name = str(rjob.get("name"))
        job_spec = (rjob.get("template") or {}).get("spec") or {}
        for i, rule in enumerate((job_spec.get("podFailurePolicy") or {}).get("rules") or []):
            conditions = rule.get("onPodConditions") or []
            if any(
                c.get("type") == DISRUPTION_TARGET and c.get("status", "True") == "True"
                for c in conditions
            ):
                if rule.get("action") == "Ignore":
                    break
                return (
                    f"replicatedJob {name}: podFailurePolicy rule {i} answers"
                    f" {DISRUPTION_TARGET} with {rule.get('action')}, not Ignore"
                )
        else:
            return (
                f"replicatedJob {name}: no podFailurePolicy rule answers"
                f" {DISRUPTION_TARGET} with Ignore"
            )
    return None
