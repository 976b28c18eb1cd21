"""The Kubernetes side of the supervisor: API client, discovery, backend, sensing, leader
election. Nothing outside this package imports the `kubernetes` client.

Layout (flat: each family of actions is a module beside the rest):

The API
    client.py          the ApiClient, from a kubeconfig or the service account
    calls.py           every request of the backend: fenced, bounded, retried
    errors.py          the package's exceptions (KubeError and below); where the client's
                       ApiException is translated

The cluster, as the watches show it
    informer.py        list-then-watch cache of one kind
    discovery.py       the informers, and what they tell of JobSets, pods and nodes
    objects.py         names and pure readings of the objects (no I/O)
    sensing.py         events raised from what the watches see
    recovery.py        swapped-out nodes given back once healthy (an uncordon action)

The backend and its actions
    backend.py         KubeBackend: lifecycle, views, dispatch to the families below
    action_context.py  ActionContext: the API, the cache, settings and hooks they share
    rmw.py             read, patch, read-modify-write; journal entries planned and
                       finished; the Events that say what was done
    journal.py         JournalEntry: the action journal kept on an object, and its codec
    events.py          Kubernetes Events, named after the action
    generations.py     which pods or Jobs a restart acts on, or why it is skipped
    failure_policy.py  what the controllers do with evicted pods, read from the JobSet
    restart.py         restart_in_place, restart_workload
    in_process.py      in-process healing (restart_in_place, hot_swap of JobSets that
                       allow it); worlds.py: their torch.distributed worlds
    eviction.py        evicting pods (delete as the fallback); force_delete_pod
    nodes.py           cordon, uncordon, hot_swap; the Node edits they make
    scale.py           scale_down, scale_up: the JobSet recreated
    emergency.py       emergency_checkpoint: the fan-out to the host monitors
    pod_links.py       what host monitors are told of the pods: worlds, partners

The supervisor's replicas and agents
    leader.py          leader election on a Lease: the supervisor run while it is held
    lease.py           one replica's side of the Lease: acquire, renew, check, release
    token_review.py    host monitors' tokens, reviewed by the API server
"""
