"""When a pod may be deleted with grace 0: only where its old process cannot still run.

A NotReady node may be dead, or only cut off from the API server while its pods train on
and write. Deleting such a pod with grace 0 frees its name and its place at once, so its
replacement can start beside a process that still runs: the split brain Kubernetes warns
about for stateful workloads, and the reason it has the `node.kubernetes.io/out-of-service`
taint. So a pod is force-deleted only when:

- its node is Ready (its kubelet is there to kill what the deletion leaves), or gone;
- its node carries the out-of-service taint (someone made sure it is down);
- or the setting `kube_platform_fences_nodes` says the platform fences nodes itself.

Otherwise the pod is left terminating: it goes when the node comes back (its kubelet ends
it, and its host monitor kills what the supervisor refuses as an older world's) or when
the taint is added; the action's result says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.config_parts import KubernetesSettings
from supervisor.kube import objects as o
from supervisor.kube.objects import Obj

OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    why: str

    def result(self) -> dict[str, str]:
        """How the action's result says it: `force_deleted` or `waiting`, and why."""
        return {"status": "force_deleted" if self.allowed else "waiting", "why": self.why}


def may_force_delete(settings: KubernetesSettings, name: str | None, node: Obj | None) -> Verdict:
    """Whether the pods of node `name` (its object `node`, None when gone) may be deleted
    with grace 0."""
    if name is None:
        return Verdict(True, "the pod is on no node")
    if node is None:
        return Verdict(True, f"node {name} is gone")
    if o.node_ready(node):
        return Verdict(True, f"node {name} is Ready: its kubelet ends what is left")
    if o.has_taint(node, OUT_OF_SERVICE):
        return Verdict(True, f"node {name} carries the {OUT_OF_SERVICE} taint")
    if settings.kube_platform_fences_nodes:
        return Verdict(True, f"node {name} is NotReady; the platform fences nodes itself")
    return Verdict(
        False,
        f"node {name} is NotReady but not known to be down: its pods may still run, so they "
        f"are not deleted with grace 0; they go when the node is back (its host monitor "
        f"kills its older world's workers) or once it carries the {OUT_OF_SERVICE} taint",
    )
