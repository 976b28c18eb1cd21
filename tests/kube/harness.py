"""Shared set-up of the Kubernetes backend tests: a FakeKube cluster with GPU nodes and a
JobSet, the backend started against it through the real client, and recording hooks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from supervisor.actuator.backend import BackendHooks, Fenced
from supervisor.config import Settings
from supervisor.domain import ActionRecord, ActionRequest, ActionStatus, ActionType, Event, utcnow
from supervisor.kube.backend import KubeBackend
from tests.kube import FakeKube

NS = "default"
GPU = {"gpu": "true"}
JS = "jobset.sigs.k8s.io/"


@dataclass
class Hooks:
    """What the supervisor would be given; records what the backend raises and asks."""

    events: list[Event] = field(default_factory=list)
    requests: list[tuple[ActionRequest, str]] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)
    heartbeating: dict[str, bool] = field(default_factory=dict)
    #: Recorded events by id, as the store would answer.
    recorded: dict[int, Event] = field(default_factory=dict)
    #: Set: the replica may no longer act (the fence raises Fenced with this reason).
    fenced: str | None = None

    async def request(self, request: ActionRequest, key: str) -> None:
        self.requests.append((request, key))

    async def event(self, event_id: int) -> Event | None:
        return self.recorded.get(event_id)

    def fence(self) -> None:
        if self.fenced is not None:
            raise Fenced(self.fenced)

    def hooks(self) -> BackendHooks:
        return BackendHooks(
            raise_events=self.events.extend,
            request_action=self.request,
            node_address=self.addresses.get,
            node_heartbeating=self.heartbeating.get,
            event=self.event,
            fence=self.fence,
        )

    def of(self, type_: str) -> list[Event]:
        return [e for e in self.events if e.type.value == type_]


def jobset(
    name: str = "train",
    *,
    replicas: int = 2,
    parallelism: int = 1,
    gpus: int = 8,
    annotations: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    failure_policy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A JobSet as "JobSet requirements" (docs/kubernetes.md) asks: backoffLimit 0 and a pod
    failure policy that fails the Job on DisruptionTarget, restarts not counted."""
    container: dict[str, Any] = {
        "name": "trainer",
        "image": "trainer:1",
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    job_spec = {
        "parallelism": parallelism,
        "completions": parallelism,
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                }
            ]
        },
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 30,
                "containers": [container],
            }
        },
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "annotations": annotations or {}, "labels": {"team": "ml"}},
        "spec": {
            "failurePolicy": failure_policy
            or {
                "maxRestarts": 3,
                "rules": [
                    {
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    }
                ],
            },
            "replicatedJobs": [
                {"name": "workers", "replicas": replicas, "template": {"spec": job_spec}}
            ],
        },
    }


def running_pods(kube: FakeKube, name: str = "train") -> list[dict[str, Any]]:
    return [
        p
        for p in kube.objects("Pod", NS, label_selector=f"{JS}jobset-name={name}")
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def pods_running(kube: FakeKube, count: int, name: str = "train") -> list[dict[str, Any]]:
    pods = running_pods(kube, name)
    return pods if len(pods) == count else []


def setup_cluster(kube: FakeKube, *, nodes: int = 4, **js: Any) -> list[dict[str, Any]]:
    """`nodes` 8-GPU nodes labelled gpu=true, and a JobSet running on as many as it needs."""
    for i in range(nodes):
        kube.add_node(f"gpu-{i}", gpus=8, labels=GPU)
    body = jobset(**js)
    kube.create(body)
    want = sum(
        r["replicas"] * r["template"]["spec"]["parallelism"] for r in body["spec"]["replicatedJobs"]
    )
    return kube.wait_for(lambda: pods_running(kube, want, body["metadata"]["name"]), 10)


def action(
    type_: ActionType,
    *,
    key: str = "k1",
    job: str | None = "train",
    node: str | None = None,
    id_: int = 1,
    reason: str = "test",
    event_id: int | None = None,
    **params: Any,
) -> ActionRecord:
    return ActionRecord(
        id=id_,
        type=type_,
        status=ActionStatus.RUNNING,
        idempotency_key=key,
        source="test",
        created_at=utcnow(),
        job=job,
        node=node,
        params=params,
        reason=reason,
        event_id=event_id,
    )


@asynccontextmanager
async def started(
    kube: FakeKube, settings: Settings, hooks: Hooks | None = None, **options: Any
) -> AsyncIterator[KubeBackend]:
    values: dict[str, Any] = {
        "request_timeout_s": 2.0,
        "watch_timeout_s": 2,
        "api_backoff_s": (0.05, 0.2),
        "eviction_patience_s": 1.0,
        **options,
    }
    backend = KubeBackend(settings, kube.client(), **values)
    await backend.start((hooks or Hooks()).hooks())
    try:
        yield backend
    finally:
        await backend.close()


def kube_settings(make: Callable[..., Settings], **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "backend": "kubernetes",
        "kube_gpu_node_selector": "gpu=true",
        "pod_termination_threshold_s": 10.0,
        "jobset_downtime_threshold_s": 60.0,
        "node_recovery_healthy_s": 60.0,
        "min_num_dp_replicas": 1,
        "max_num_dp_replicas": 2,
        "num_dp_replicas": 2,
        "num_nodes_per_dp": 1,
        "emergency_checkpoint_timeout_s": 5.0,
    }
    values.update(overrides)
    return make(**values)
