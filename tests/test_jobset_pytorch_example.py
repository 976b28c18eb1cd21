"""The example JobSet of a PyTorch job (helm/.../examples/jobset-pytorch.yaml).

No Kubernetes API server installs here: the Job template is validated against the
Kubernetes schemas, and each pod's command runs as a local process with the environment
the JobSet controller and the downward API would give it (labels, the completion index).
Its rank-0 DNS name (the JobSet's headless Service) cannot resolve here, so MASTER_ADDR is
the one value replaced, by 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from supervisor.kube import failure_policy
from supervisor.kube import objects as kube_objects
from supervisor.local.ports import free_port
from tests.test_helm_chart import CHART, K8S_VERSION

pytest.importorskip("torch")

EXAMPLE = CHART / "examples" / "jobset-pytorch.yaml"
ROOT = Path(__file__).resolve().parent.parent


def load(path: Path) -> dict[str, Any]:
    jobset: dict[str, Any] = yaml.safe_load(path.read_text())
    return jobset


def trainer_of(jobset: dict[str, Any]) -> dict[str, Any]:
    (replicated,) = jobset["spec"]["replicatedJobs"]
    (trainer,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    container: dict[str, Any] = trainer
    return container


def test_the_pytorch_jobset_is_a_valid_supervised_jobset_that_heals_in_process() -> None:
    jobset, numpy_jobset = load(EXAMPLE), load(CHART / "examples" / "jobset.yaml")
    # In-process: annotated, and a lost or crashed pod is replaced by its Job alone,
    # which is what the backend checks before it heals in-process.
    assert kube_objects.in_process_enabled(jobset)
    assert failure_policy.in_process_refusal(jobset) is None
    # Its full restarts therefore go by deleting the Jobs, not by evicting pods.
    refusal = failure_policy.eviction_restart_refusal(jobset)
    assert refusal is not None and "exit codes" in refusal
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job_spec = replicated["template"]["spec"]
    (numpy_replicated,) = numpy_jobset["spec"]["replicatedJobs"]
    assert job_spec["completionMode"] == numpy_replicated["template"]["spec"]["completionMode"]
    rules = job_spec["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["FailJob", "Ignore", "Ignore"]
    assert rules[0]["onExitCodes"]["values"] == [2]  # bad settings: retrying cannot help
    # The numpy JobSet (not in-process) is refused, naming why.
    assert "DisruptionTarget with FailJob" in str(failure_policy.in_process_refusal(numpy_jobset))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "w"}, "spec": job_spec}
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    # DDP: one node per replica, a pod per node with a rank per GPU, and the shape the
    # Kubernetes backend reads says so.
    shape = kube_objects.job_shape(jobset, min_default=2, max_default=4, nodes_default=4)
    assert (shape.num_dp_replicas, shape.num_nodes_per_dp, shape.nproc_per_node) == (2, 1, 8)
    assert shape.world_size == 16
    assert job_spec["parallelism"] == job_spec["completions"] == 1
    env = {v["name"]: v for v in trainer_of(jobset)["env"]}
    assert env["NPROC_PER_NODE"]["value"] == str(shape.nproc_per_node)
    limits = trainer_of(jobset)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == shape.nproc_per_node
    numpy_env = {v["name"]: v for v in trainer_of(numpy_jobset)["env"]}
    for name in ("HOST_MONITOR_URL", "HOST_MONITOR_JOB", "HOST_MONITOR_WORKER_TOKEN"):
        assert env[name] == numpy_env[name], name
    assert env[kube_objects.ENV_NUM_DP_REPLICAS]["value"] == str(replicated["replicas"])
    assert "WORLD_SIZE" not in env  # follows NUM_DP_REPLICAS, which scaling rewrites
    # The supervisor assigns each pod its world, by the pod's UID.
    assert float(env["WORLD_WAIT_S"]["value"]) > 0
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    # MASTER_ADDR names rank 0's pod under the JobSet's headless Service.
    name = jobset["metadata"]["name"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert env["MASTER_ADDR"]["value"] == f"{name}-{replicated['name']}-0-0.{name}"


def resolve_env(trainer: dict[str, Any], labels: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet would set it (no secrets here)."""
    env: dict[str, str] = {}
    for var in trainer["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path == "metadata.uid":
                env[var["name"]] = "0b6c8f52-5a1e-4c1f-9a52-000000000000"
                continue
            key = path.removeprefix("metadata.labels['").removesuffix("']")
            env[var["name"]] = labels[key]
    return env


def test_each_pod_command_forms_the_torch_world_and_trains(tmp_path: Path) -> None:
    """Two pods of two ranks each (the example's 8 would be 16 processes on this
    machine's 2 cores)."""
    jobset = load(EXAMPLE)
    trainer = trainer_of(jobset)
    port = str(free_port())
    procs = []
    for job_index in (0, 1):
        labels = {
            kube_objects.JOB_INDEX: str(job_index),
            kube_objects.JOBSET_NAME: jobset["metadata"]["name"],
        }
        env = resolve_env(trainer, labels)
        env.pop("HOST_MONITOR_URL")  # no host monitor: the worker client runs offline
        env.update(
            JOB_COMPLETION_INDEX="0",  # set by Kubernetes in an Indexed Job's pods
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            TOTAL_STEPS="12",
            D_MODEL="64",
            N_LAYERS="2",
            N_HEADS="4",
            SEQ_LEN="32",
            CHECKPOINT_RAM_DIR=str(tmp_path / f"ram-{job_index}"),
            CHECKPOINT_DURABLE_DIR=str(tmp_path / "durable"),
            S3_CHECKPOINTING_FREQ="10",
            OUTPUT_DIR=str(tmp_path / "output"),
            NPROC_PER_NODE="2",
        )
        base = {k: v for k, v in os.environ.items() if not k.startswith(("HOST_", "CHECKPOINT_"))}
        procs.append(
            subprocess.Popen(
                trainer["command"],
                env={
                    **base,
                    **env,
                    "PATH": f"{Path(sys.executable).parent}:{base.get('PATH', '')}",
                    "PYTHONPATH": str(ROOT),
                    "OMP_NUM_THREADS": "1",
                },
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        outputs.append(out)
    for pod, out in enumerate(outputs):
        for rank in (2 * pod, 2 * pod + 1):  # the pod's ranks, in torchrun's order
            assert f"torch workload rank={rank}: start attempt=0 world_size=4: " in out
            assert f"rank={rank}: step=10/12" in out
    assert (tmp_path / "output" / "weights.sha256").exists()
