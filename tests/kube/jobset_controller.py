"""A small model of the JobSet controller (kubernetes-sigs/jobset, ``pkg/controllers``).

Modelled, following ``JobSetReconciler.reconcile``:

- child Jobs ``<jobset>-<replicatedJob>-<index>`` for every replica, owned by the
  JobSet (controller ownerReference), labelled and annotated (Job and pod template)
  with ``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``,
  ``replicatedjob-replicas``, ``global-replicas``, ``job-index``,
  ``job-global-index``, ``job-key`` (sha1 of ``<ns>/<job>``) and ``restart-attempt``
  (= ``status.restarts``); pod ``subdomain`` when DNS hostnames are on; a missing Job
  (deleted from outside) is created again.
- Jobs whose ``restart-attempt`` is below ``status.restarts`` are deleted
  (propagationPolicy Foreground); new ones are created once the old ones are gone.
- a failed child Job runs the failure policy: no ``failurePolicy`` -> JobSet Failed
  (reason FailedJobs); else the first rule matching (``onJobFailureReasons``,
  ``targetReplicatedJobs``) or the default RestartJobSet: restart (``restarts`` and
  ``restartsCountTowardsMax`` + 1) unless ``restartsCountTowardsMax >= maxRestarts``
  (-> Failed, reason ReachedMaxRestarts); FailJobSet; RestartJobSetAndIgnoreMaxRestarts.
- success policy (All / Any over ``targetReplicatedJobs``) -> Completed.
- a finished (Completed/Failed) JobSet deletes its active Jobs.
- ``spec.suspend``: child Jobs get ``spec.suspend`` (so the job controller deletes
  their pods) and the ``Suspended`` condition (SuspendedJobs / ResumeJobs).
- ``status.replicatedJobsStatus`` (ready, succeeded, failed, active, suspended).

Not modelled: the headless Service, startupPolicy InOrder / dependsOn, coordinator,
exclusive placement, ttlSecondsAfterFinished, RecreateJob / BlockingRecreate, elastic
JobSets, Kubernetes Events emitted by the controller, managedBy other than skipping.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from .resources import (
    JOBS,
    JOBSETS,
    ApiError,
    Obj,
    condition,
    condition_true,
    controller_ref,
    deep,
    owner_ref_to,
    set_condition,
)

if TYPE_CHECKING:
    from .apiserver import ApiServer

PREFIX = "jobset.sigs.k8s.io/"
JOBSET_NAME = PREFIX + "jobset-name"
REPLICATED_JOB_NAME = PREFIX + "replicatedjob-name"
REPLICATED_JOB_REPLICAS = PREFIX + "replicatedjob-replicas"
GLOBAL_REPLICAS = PREFIX + "global-replicas"
JOB_INDEX = PREFIX + "job-index"
JOB_GLOBAL_INDEX = PREFIX + "job-global-index"
JOB_KEY = PREFIX + "job-key"
RESTART_ATTEMPT = PREFIX + "restart-attempt"
CONTROLLER_NAME = "jobset.sigs.k8s.io/jobset-controller"


def job_name(js: str, rjob: str, index: int) -> str:
    return f"{js}-{rjob}-{index}"


def _finished(status: Obj) -> bool:
    return any(
        c.get("type") in ("Completed", "Failed") and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _job_finished(job: Obj) -> str:
    for t in ("Complete", "Failed"):
        if condition_true(job, t):
            return t
    return ""


class JobSetController:
    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self.store = api.store

    def reconcile(self) -> None:
        for js in self.store.list("jobsets"):
            try:
                self._reconcile(js)
            except ApiError as e:
                if e.code not in (404, 409):
                    raise

    def _reconcile(self, js: Obj) -> None:
        m = js["metadata"]
        if m.get("deletionTimestamp"):
            return
        spec = js.get("spec") or {}
        if spec.get("managedBy") not in (None, CONTROLLER_NAME):
            return
        ns, uid = m["namespace"], m["uid"]
        new = deep(js)
        status = new.setdefault("status", {})
        status.setdefault("restarts", 0)
        restarts = int(status["restarts"])

        jobs = [
            j
            for j in self.store.list("jobs", ns)
            if (ref := controller_ref(j)) is not None
            and ref.get("uid") == uid
            and ref.get("kind") == "JobSet"
        ]
        previous: list[Obj] = []
        active: list[Obj] = []
        successful: list[Obj] = []
        failed: list[Obj] = []
        for j in jobs:
            try:
                attempt = int((j["metadata"].get("labels") or {}).get(RESTART_ATTEMPT, "-1"))
            except ValueError:
                attempt = -1
            if attempt < restarts:
                previous.append(j)
                continue
            {"": active, "Complete": successful, "Failed": failed}[_job_finished(j)].append(j)

        status["replicatedJobsStatus"] = self._replicated_statuses(spec, active, successful, failed)

        if _finished(status):
            self._delete_jobs(active)
            self._write_status(js, new)
            return
        self._delete_jobs(previous)
        if failed:
            self._failure_policy(spec, status, failed)
            self._write_status(js, new)
            return
        if successful and self._success(spec, successful):
            set_condition(
                new,
                {
                    "type": "Completed",
                    "status": "True",
                    "reason": "AllJobsCompleted",
                    "message": "jobset completed successfully",
                },
            )
            status["terminalState"] = "Completed"
            self._write_status(js, new)
            return
        existing = {j["metadata"]["name"] for j in jobs}
        for rjob in spec.get("replicatedJobs") or []:
            for idx in range(int(rjob.get("replicas", 1))):
                if job_name(m["name"], rjob["name"], idx) not in existing:
                    self.api.create(JOBS, ns, self._construct_job(js, rjob, idx, restarts))
        suspended = bool(spec.get("suspend"))
        for j in active:
            if bool((j.get("spec") or {}).get("suspend")) != suspended:
                body = deep(j)
                body["spec"]["suspend"] = suspended
                self.api.update(JOBS, ns, j["metadata"]["name"], body)
        if suspended:
            set_condition(
                new,
                {
                    "type": "Suspended",
                    "status": "True",
                    "reason": "SuspendedJobs",
                    "message": "jobset is suspended",
                },
            )
        elif condition_true(js, "Suspended"):
            set_condition(
                new,
                {
                    "type": "Suspended",
                    "status": "False",
                    "reason": "ResumeJobs",
                    "message": "jobset is resumed",
                },
            )
        self._write_status(js, new)

    # --- pieces -----------------------------------------------------------------

    @staticmethod
    def _replicated_statuses(
        spec: Obj, active: list[Obj], successful: list[Obj], failed: list[Obj]
    ) -> list[Obj]:
        out = []
        for rjob in spec.get("replicatedJobs") or []:
            name = rjob["name"]

            def mine(jobs: list[Obj], name: str = name) -> list[Obj]:
                return [
                    j
                    for j in jobs
                    if (j["metadata"].get("labels") or {}).get(REPLICATED_JOB_NAME) == name
                ]

            ready = 0
            act = 0
            susp = 0
            for j in mine(active):
                js_ = j.get("spec") or {}
                st = j.get("status") or {}
                pods = int(js_.get("parallelism", 1))
                if js_.get("completions") is not None:
                    pods = min(pods, int(js_["completions"]))
                if int(st.get("succeeded", 0)) + int(st.get("ready", 0)) >= pods:
                    ready += 1
                if int(st.get("active", 0)) > 0:
                    act += 1
                if js_.get("suspend"):
                    susp += 1
            out.append(
                {
                    "name": name,
                    "ready": ready,
                    "succeeded": len(mine(successful)),
                    "failed": len(mine(failed)),
                    "active": act,
                    "suspended": susp,
                }
            )
        return out

    def _failure_policy(self, spec: Obj, status: Obj, failed: list[Obj]) -> None:
        def fail_time(j: Obj) -> str:
            c = condition(j, "Failed") or {}
            return str(c.get("lastTransitionTime", ""))

        failed = sorted(failed, key=fail_time)
        policy = spec.get("failurePolicy")
        if policy is None:
            self._fail(
                status, "FailedJobs", "jobset failed due to one or more job failures", failed[0]
            )
            return
        action, job = "RestartJobSet", failed[0]
        for rule in policy.get("rules") or []:
            reasons = rule.get("onJobFailureReasons") or []
            targets = rule.get("targetReplicatedJobs") or []
            hit = next(
                (
                    j
                    for j in failed
                    if (not reasons or (condition(j, "Failed") or {}).get("reason") in reasons)
                    and (
                        not targets
                        or (j["metadata"].get("labels") or {}).get(REPLICATED_JOB_NAME) in targets
                    )
                ),
                None,
            )
            if hit is not None:
                action, job = rule.get("action", "RestartJobSet"), hit
                break
        if action == "FailJobSet":
            self._fail(
                status,
                "FailJobSetFailurePolicyAction",
                "applying FailJobSet failure policy action",
                job,
            )
        elif action == "RestartJobSetAndIgnoreMaxRestarts":
            status["restarts"] = int(status.get("restarts", 0)) + 1
        else:
            counted = int(status.get("restartsCountTowardsMax", 0))
            if counted >= int(policy.get("maxRestarts", 0)):
                self._fail(
                    status,
                    "ReachedMaxRestarts",
                    "jobset failed due to reaching max number of restarts",
                    job,
                )
            else:
                status["restarts"] = int(status.get("restarts", 0)) + 1
                status["restartsCountTowardsMax"] = counted + 1

    @staticmethod
    def _fail(status: Obj, reason: str, message: str, job: Obj) -> None:
        holder = {"status": status}
        set_condition(
            holder,
            {
                "type": "Failed",
                "status": "True",
                "reason": reason,
                "message": f"{message} (first failed job: {job['metadata']['name']})",
            },
        )
        status["terminalState"] = "Failed"

    @staticmethod
    def _success(spec: Obj, successful: list[Obj]) -> bool:
        policy = spec.get("successPolicy") or {"operator": "All"}
        targets = policy.get("targetReplicatedJobs") or [
            r["name"] for r in spec.get("replicatedJobs") or []
        ]
        matching = [
            j
            for j in successful
            if (j["metadata"].get("labels") or {}).get(REPLICATED_JOB_NAME) in targets
        ]
        if policy.get("operator") == "Any":
            return len(matching) >= 1
        expected = sum(
            int(r.get("replicas", 1))
            for r in spec.get("replicatedJobs") or []
            if r["name"] in targets
        )
        return len(matching) >= expected

    def _delete_jobs(self, jobs: list[Obj]) -> None:
        for j in jobs:
            jm = j["metadata"]
            if jm.get("deletionTimestamp"):
                continue
            try:
                self.api.delete(
                    JOBS, jm["namespace"], jm["name"], {"propagationPolicy": "Foreground"}
                )
            except ApiError as e:
                if e.code != 404:
                    raise

    def _write_status(self, old: Obj, new: Obj) -> None:
        if (new.get("status") or {}) != (old.get("status") or {}):
            m = old["metadata"]
            self.api.update(
                JOBSETS, m["namespace"], m["name"], new, subresource="status", trusted=True
            )

    @staticmethod
    def _construct_job(js: Obj, rjob: Obj, idx: int, restarts: int) -> Obj:
        m = js["metadata"]
        spec = js.get("spec") or {}
        name = job_name(m["name"], rjob["name"], idx)
        rjobs = spec.get("replicatedJobs") or []
        global_index = 0
        for r in rjobs:
            if r["name"] == rjob["name"]:
                global_index += idx
                break
            global_index += int(r.get("replicas", 1))
        values = {
            JOBSET_NAME: m["name"],
            REPLICATED_JOB_NAME: rjob["name"],
            RESTART_ATTEMPT: str(restarts),
            REPLICATED_JOB_REPLICAS: str(int(rjob.get("replicas", 1))),
            GLOBAL_REPLICAS: str(sum(int(r.get("replicas", 1)) for r in rjobs)),
            JOB_INDEX: str(idx),
            JOB_KEY: hashlib.sha1(f"{m['namespace']}/{name}".encode()).hexdigest(),
            JOB_GLOBAL_INDEX: str(global_index),
        }
        template = deep(rjob.get("template") or {})
        tmeta = template.get("metadata") or {}
        jspec = template.get("spec") or {}
        ptmpl = jspec.setdefault("template", {})
        pmeta = ptmpl.setdefault("metadata", {})
        pmeta["labels"] = {**(pmeta.get("labels") or {}), **values}
        pmeta["annotations"] = {**(pmeta.get("annotations") or {}), **values}
        network = spec.get("network") or {}
        if network.get("enableDNSHostnames"):
            ptmpl.setdefault("spec", {})["subdomain"] = network.get("subdomain") or m["name"]
        jspec["suspend"] = bool(spec.get("suspend"))
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": m["namespace"],
                "labels": {**(tmeta.get("labels") or {}), **values},
                "annotations": {**(tmeta.get("annotations") or {}), **values},
                "ownerReferences": [owner_ref_to(js, JOBSETS)],
            },
            "spec": jspec,
        }
