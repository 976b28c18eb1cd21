"""Names and pure readings of Kubernetes objects (raw JSON dicts), shared by the modules
of this package: JobSet labels, our annotations, pod and node states.

Objects are kept as the API server sends them (plain dicts), not as the client's models:
the watch streams are parsed as JSON once, and custom resources (JobSets) are dicts anyway.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

Obj = dict[str, Any]

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"

# Labels the JobSet controller puts on child Jobs and their pods.
JS = "jobset.sigs.k8s.io/"
JOBSET_NAME = JS + "jobset-name"
REPLICATED_JOB_NAME = JS + "replicatedjob-name"
JOB_INDEX = JS + "job-index"
RESTART_ATTEMPT = JS + "restart-attempt"

# Annotations users set on a JobSet (bounds of scaling), and ours.
OURS = "resiliency.supervisor.io/"
MIN_REPLICAS = OURS + "min-num-dp-replicas"
MAX_REPLICAS = OURS + "max-num-dp-replicas"
NODES_PER_DP = OURS + "num-nodes-per-dp"
#: Ranks (worker processes) in each pod, as torchrun's --nproc-per-node (default 1).
NPROC_PER_NODE = OURS + "nproc-per-node"
DP_REPLICATED_JOB = OURS + "dp-replicated-job"
NUM_DP_REPLICAS = OURS + "num-dp-replicas"
ORIGINAL_SPEC = OURS + "original-spec"
RECREATE = OURS + "recreate"
JOURNAL = OURS + "actions"
# A JobSet that heals in-process (users set it), and its current torch.distributed world.
IN_PROCESS = OURS + "in-process-restart"
WORLD = OURS + "world"

# The Job controller's index of a pod of an Indexed Job (label and annotation).
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"

# Environment variables set on the workers of a rescaled JobSet.
ENV_NUM_DP_REPLICAS = "NUM_DP_REPLICAS"
ENV_NNODES = "NNODES"

# Values of the node health label (those of HyperPod's `node-health-status`).
SCHEDULABLE = "Schedulable"
UNSCHEDULABLE = "Unschedulable"
PENDING_REPLACEMENT = "UnschedulablePendingReplacement"

COMPONENT = "resiliency-supervisor"


def meta(obj: Obj) -> Obj:
    m: Obj = obj.setdefault("metadata", {})
    return m


def name_of(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def uid_of(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("uid", ""))


def labels_of(obj: Obj) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("labels") or {})


def annotations_of(obj: Obj) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("annotations") or {})


def key_of(obj: Obj) -> str:
    m = obj.get("metadata", {})
    ns = m.get("namespace") or ""
    return f"{ns}/{m.get('name', '')}" if ns else str(m.get("name", ""))


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def rfc3339(when: datetime | None = None) -> str:
    return (when or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def created(obj: Obj) -> datetime | None:
    """`metadata.creationTimestamp`: second precision, as the API server keeps it."""
    return parse_time(obj.get("metadata", {}).get("creationTimestamp"))


def restart_attempt(obj: Obj) -> int:
    """The JobSet restart a child Job or pod belongs to (its `restart-attempt` label)."""
    try:
        return int(labels_of(obj).get(RESTART_ATTEMPT, "0"))
    except ValueError:
        return 0


def condition(obj: Obj, type_: str) -> Obj | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return None


# --- pods ---------------------------------------------------------------------------------


def jobset_of(pod: Obj) -> str | None:
    return labels_of(pod).get(JOBSET_NAME)


def owner_uid(obj: Obj) -> str | None:
    """The UID of the object's controller (a pod's Job), from its ownerReferences."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def terminating(obj: Obj) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def terminating_since(pod: Obj) -> datetime | None:
    """When the pod's deletion was asked: the API sets `deletionTimestamp` to that moment
    plus the grace period, and keeps the grace period in `deletionGracePeriodSeconds`."""
    m = pod.get("metadata", {})
    deadline = parse_time(m.get("deletionTimestamp"))
    if deadline is None:
        return None
    grace = int(m.get("deletionGracePeriodSeconds") or 0)
    return deadline.fromtimestamp(deadline.timestamp() - grace, UTC)


def pod_running(pod: Obj) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and not terminating(pod)


def pod_finished(pod: Obj) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def pod_unschedulable(pod: Obj) -> bool:
    """Pending because no node fits it (the scheduler's PodScheduled=False/Unschedulable)."""
    c = condition(pod, "PodScheduled")
    return (
        not terminating(pod)
        and pod.get("status", {}).get("phase") == "Pending"
        and c is not None
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
    )


def node_of(pod: Obj) -> str | None:
    node = pod.get("spec", {}).get("nodeName")
    return str(node) if node else None


# --- nodes --------------------------------------------------------------------------------


def node_ready(node: Obj) -> bool:
    c = condition(node, "Ready")
    return c is not None and c.get("status") == "True"


def node_schedulable(node: Obj) -> bool:
    return not node.get("spec", {}).get("unschedulable") and node_ready(node)


def internal_ip(node: Obj) -> str | None:
    for address in node.get("status", {}).get("addresses") or []:
        if address.get("type") == "InternalIP":
            return str(address.get("address"))
    return None


def has_taint(node: Obj, key: str) -> bool:
    return any(t.get("key") == key for t in node.get("spec", {}).get("taints") or [])


def cordoned(node: Obj, taint_key: str) -> bool:
    """Kept off for new pods: cordoned (by us or an operator), or carrying our taint."""
    return bool(node.get("spec", {}).get("unschedulable")) or has_taint(node, taint_key)


# --- JobSets ------------------------------------------------------------------------------


def jobset_finished(js: Obj) -> bool:
    for type_ in ("Completed", "Failed"):
        c = condition(js, type_)
        if c is not None and c.get("status") == "True":
            return True
    return False


def jobset_restarts(js: Obj) -> int:
    """How many times the JobSet controller restarted it (`status.restarts`): the
    `restart-attempt` label of its current Jobs and pods."""
    return int(js.get("status", {}).get("restarts") or 0)


def job_failed(job: Obj) -> bool:
    """A Job that failed or is failing (`FailureTarget` comes first, then `Failed`)."""
    for type_ in ("Failed", "FailureTarget"):
        c = condition(job, type_)
        if c is not None and c.get("status") == "True":
            return True
    return False


def jobset_suspended(js: Obj) -> bool:
    return bool(js.get("spec", {}).get("suspend"))


def pods_per_job(rjob: Obj) -> int:
    spec = rjob.get("template", {}).get("spec", {})
    parallelism = int(spec.get("parallelism", 1))
    completions = spec.get("completions")
    return min(parallelism, int(completions)) if completions is not None else parallelism


def expected_pods(js: Obj) -> int:
    return sum(
        int(r.get("replicas", 1)) * pods_per_job(r)
        for r in js.get("spec", {}).get("replicatedJobs") or []
    )


def pod_rank(pod: Obj, nodes_per_dp: int) -> int | None:
    """The node rank of a pod of the data-parallel replicated Job: its Job's index times
    the nodes per replica, plus its completion index (as the example JobSets compute
    RANK); None when a label is missing."""
    labels, annotations = labels_of(pod), annotations_of(pod)
    job_index = labels.get(JOB_INDEX)
    completion = labels.get(COMPLETION_INDEX) or annotations.get(COMPLETION_INDEX)
    if job_index is None or completion is None:
        return None
    try:
        return int(job_index) * nodes_per_dp + int(completion)
    except ValueError:
        return None


def container_env(pod: Obj, name: str) -> str | None:
    """The literal value of an environment variable of the pod's first container."""
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    for var in containers[0].get("env") or []:
        if var.get("name") == name and isinstance(var.get("value"), str):
            return str(var["value"])
    return None


def in_process_enabled(js: Obj) -> bool:
    return annotations_of(js).get(IN_PROCESS, "").lower() == "true"


def dp_replicated_job(js: Obj) -> Obj | None:
    """The replicated job whose replicas are the data-parallel replicas: the one named by
    our annotation, else the first."""
    rjobs = js.get("spec", {}).get("replicatedJobs") or []
    wanted = annotations_of(js).get(DP_REPLICATED_JOB)
    for rjob in rjobs:
        if wanted is None or rjob.get("name") == wanted:
            return dict(rjob)
    return None


@dataclass(frozen=True, slots=True)
class JobShape:
    """A JobSet's data-parallel replicas and bounds, from its spec and annotations."""

    name: str
    num_dp_replicas: int
    min_num_dp_replicas: int
    max_num_dp_replicas: int
    num_nodes_per_dp: int
    original_replicas: int
    nproc_per_node: int = 1

    @property
    def world_size(self) -> int:
        """The ranks of the job: a rank per worker of each of its pods."""
        return self.num_dp_replicas * self.num_nodes_per_dp * self.nproc_per_node


def _int_annotation(annotations: dict[str, str], key: str, default: int) -> int:
    try:
        return int(annotations[key])
    except (KeyError, ValueError):
        return default


def job_shape(js: Obj, *, min_default: int, max_default: int, nodes_default: int) -> JobShape:
    annotations = annotations_of(js)
    rjob = dp_replicated_job(js) or {}
    replicas = int(rjob.get("replicas", 1))
    nodes = _int_annotation(
        annotations, NODES_PER_DP, pods_per_job(rjob) if rjob else nodes_default
    )
    original = replicas
    if ORIGINAL_SPEC in annotations:
        try:
            spec = json.loads(annotations[ORIGINAL_SPEC])
            first = dp_replicated_job({"metadata": js.get("metadata", {}), "spec": spec}) or {}
            original = int(first.get("replicas", replicas))
        except (ValueError, TypeError):
            pass
    return JobShape(
        name=name_of(js),
        num_dp_replicas=replicas,
        min_num_dp_replicas=_int_annotation(annotations, MIN_REPLICAS, min_default),
        max_num_dp_replicas=_int_annotation(annotations, MAX_REPLICAS, max(max_default, original)),
        num_nodes_per_dp=nodes,
        original_replicas=original,
        nproc_per_node=max(1, _int_annotation(annotations, NPROC_PER_NODE, 1)),
    )
