"""A real Kubernetes control plane for the tests: etcd, kube-apiserver (Node and RBAC
authorization, client certificates, a service-account signing key), the controller
manager, the scheduler, the JobSet controller with its CRD and webhooks, and kwok for
nodes without a kubelet, each a process of its own on 127.0.0.1.

The binaries are those `make control-plane` builds (tools/control-plane/build.sh) into
a folder named after their versions; `KUBEBUILDER_ASSETS` names another folder holding
the same file names, as controller-runtime's envtest reads it. Every process is stopped,
and its group killed, when the control plane stops: nothing is left running.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trustme
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from supervisor.local.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "tools" / "control-plane" / "build.sh"
POD_STAGES = Path(__file__).resolve().parent / "kwok_pod_stages.yaml"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "jobset-controller",
    "kwok",
)
SERVICE_RANGE = "10.96.0.0/24"
#: The label kwok looks for: nodes carrying it have no kubelet, kwok keeps them Ready.
KWOK_NODE_LABEL = "type"
KWOK_NODE_VALUE = "kwok"
#: A pod annotated so (value "true") runs to its end on a kwok node; others run until deleted.
RUN_TO_COMPLETION = "tests.resiliency-supervisor.io/run-to-completion"
#: A JobSet sent in a dry run to learn that the controller's webhooks admit JobSets.
ADMISSION_PROBE = yaml.safe_load("""
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: admission-probe, namespace: default}
spec:
  replicatedJobs:
  - name: w
    template: {spec: {template: {spec: {restartPolicy: Never, containers: [{name: c, image: p}]}}}}
""")


class ControlPlaneError(RuntimeError):
    """A part of the control plane did not start; the message says which and why."""


def assets() -> Path:
    """The folder of the binaries: KUBEBUILDER_ASSETS, else the one the build script
    prints (building what is missing, once per machine)."""
    named = os.environ.get("KUBEBUILDER_ASSETS")
    if named:
        folder = Path(named)
    else:
        done = subprocess.run(["bash", str(BUILD)], check=True, stdout=subprocess.PIPE, text=True)
        folder = Path(done.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not (folder / b).is_file()]
    if missing:
        raise ControlPlaneError(f"KUBEBUILDER_ASSETS={folder}: no {', '.join(missing)} there")
    return folder


@dataclass
class Identity:
    """A client certificate of the cluster's CA, and a kubeconfig that uses it."""

    name: str
    kubeconfig: Path


@dataclass
class ControlPlane:
    work: Path
    bin: Path = field(default_factory=assets)
    ca: trustme.CA = field(default_factory=trustme.CA)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    url: str = ""

    # --- credentials ---------------------------------------------------------------------

    def identity(self, user: str, *groups: str) -> Identity:
        """A client certificate for `user` in `groups` (RBAC's subjects), and its
        kubeconfig."""
        safe = user.replace(":", "-")
        # A name in the certificate too: Go refuses trustme's empty, critical SAN.
        cert = self.ca.issue_cert(
            f"{safe}.users.test",
            common_name=user,
            organization_name=",".join(groups) if groups else None,
        )
        folder = self.work / "users" / safe
        folder.mkdir(parents=True, exist_ok=True)
        cert.cert_chain_pems[0].write_to_path(str(folder / "tls.crt"))
        cert.private_key_pem.write_to_path(str(folder / "tls.key"))
        return Identity(
            user,
            self._kubeconfig(
                folder,
                user,
                {
                    "client-certificate": str(folder / "tls.crt"),
                    "client-key": str(folder / "tls.key"),
                },
            ),
        )

    def token_identity(self, name: str, token: str, namespace: str = "default") -> Identity:
        """A kubeconfig that authenticates with a bearer token (a ServiceAccount's)."""
        folder = self.work / "users" / name
        folder.mkdir(parents=True, exist_ok=True)
        return Identity(name, self._kubeconfig(folder, name, {"token": token}, namespace))

    def _kubeconfig(
        self, folder: Path, user: str, credentials: dict[str, str], namespace: str = "default"
    ) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.work / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [
                {
                    "name": "local",
                    "context": {"cluster": "local", "user": user, "namespace": namespace},
                }
            ],
            "current-context": "local",
        }
        path = folder / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    # --- processes -----------------------------------------------------------------------

    def _start(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = (self.work / f"{name}.log").open("ab")
        # Killed with the test process, even when it is SIGKILLed (setpriv --pdeathsig,
        # util-linux's): a session killed mid-run leaves no control plane running.
        guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        proc = subprocess.Popen(
            [*guard, str(self.bin / args[0]), *args[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.work,
            env=env,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def _until(self, name: str, ready: Callable[[], bool], within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited {proc.returncode}:\n{self.log(name)}")
            with contextlib.suppress(httpx.HTTPError, OSError):
                if ready():
                    return
            time.sleep(0.2)
        raise ControlPlaneError(f"{name} not ready within {within:g} s:\n{self.log(name)}")

    def start(self, within: float = 120.0) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.ca.cert_pem.write_to_path(str(self.work / "ca.crt"))
        self._start_etcd(within)
        self._start_apiserver(within)
        self.admin = self.identity("admin", "system:masters")
        self._start_controller_manager()
        self._start_scheduler()
        self._start_jobset(within)
        self._start_kwok(within)

    def _start_etcd(self, within: float) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._start(
            "etcd",
            [
                "etcd",
                "--name=local",
                f"--data-dir={self.work / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=local=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",  # a test's cluster: speed over durability
                "--log-level=warn",
            ],
        )
        self._until("etcd", lambda: httpx.get(f"{self.etcd_url}/health").is_success, within)

    def _start_apiserver(self, within: float) -> None:
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        serving = self.ca.issue_cert(
            "127.0.0.1", "localhost", "kubernetes", "kubernetes.default.svc", "10.96.0.1"
        )
        serving.cert_chain_pems[0].write_to_path(str(self.work / "apiserver.crt"))
        serving.private_key_pem.write_to_path(str(self.work / "apiserver.key"))
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.work / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        (self.work / "sa.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        self._start(
            "kube-apiserver",
            [
                "kube-apiserver",
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={self.work / 'apiserver.crt'}",
                f"--tls-private-key-file={self.work / 'apiserver.key'}",
                f"--client-ca-file={self.work / 'ca.crt'}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.work / 'sa.pub'}",
                f"--service-account-signing-key-file={self.work / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--profiling=false",
                # ConfigMaps' watches from etcd itself, so that compacting etcd expires
                # them at once (tests/test_kube_informer_real.py); every other kind's
                # from the watch cache, as by default.
                "--watch-cache-sizes=configmaps#0",
            ],
        )
        trust = ssl.create_default_context(cafile=str(self.work / "ca.crt"))
        self._until(
            "kube-apiserver",
            lambda: httpx.get(f"{self.url}/readyz", verify=trust).is_success,
            within,
        )

    def _start_controller_manager(self) -> None:
        who = self.identity("system:kube-controller-manager")
        self._start(
            "kube-controller-manager",
            [
                "kube-controller-manager",
                f"--kubeconfig={who.kubeconfig}",
                f"--authentication-kubeconfig={who.kubeconfig}",
                f"--authorization-kubeconfig={who.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                f"--service-account-private-key-file={self.work / 'sa.key'}",
                f"--root-ca-file={self.work / 'ca.crt'}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
            ],
        )

    def _start_scheduler(self) -> None:
        who = self.identity("system:kube-scheduler")
        self._start(
            "kube-scheduler",
            [
                "kube-scheduler",
                f"--kubeconfig={who.kubeconfig}",
                f"--authentication-kubeconfig={who.kubeconfig}",
                f"--authorization-kubeconfig={who.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
            ],
        )

    def _start_jobset(self, within: float) -> None:
        """The JobSet controller as its release runs it, but for where its webhooks are
        served: this process on 127.0.0.1, with a certificate of the cluster's CA."""
        certs = self.work / "jobset-certs"
        certs.mkdir(exist_ok=True)
        serving = self.ca.issue_cert("127.0.0.1")
        serving.cert_chain_pems[0].write_to_path(str(certs / "tls.crt"))
        serving.private_key_pem.write_to_path(str(certs / "tls.key"))
        webhook, health = free_port(), free_port()
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": webhook, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        }
        (self.work / "jobset-config.yaml").write_text(yaml.safe_dump(config))
        manifests = self.bin / "jobset"
        self.apply_file(manifests / "crd.yaml", drop_conversion=True)
        bundle = base64.b64encode(self.ca.cert_pem.bytes()).decode()
        for doc in yaml.safe_load_all((manifests / "webhooks.yaml").read_text()):
            if not doc:
                continue
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {
                    "url": f"https://127.0.0.1:{webhook}{path}",
                    "caBundle": bundle,
                }
                if hook["rules"][0]["resources"] == ["pods"]:
                    # As the release's patch: only the pods of JobSets.
                    hook["objectSelector"] = {
                        "matchExpressions": [
                            {"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}
                        ]
                    }
            self.apply(doc)
        self._start(
            "jobset-controller",
            ["jobset-controller", f"--config={self.work / 'jobset-config.yaml'}"],
            env={**os.environ, "KUBECONFIG": str(self.admin.kubeconfig)},
        )
        self._until(
            "jobset-controller",
            lambda: httpx.get(f"http://127.0.0.1:{health}/readyz").is_success,
            within,
        )
        # Ready is not yet admitting: the controller registers its webhooks' handlers once
        # it sees the CRD served, seconds later on a loaded machine (until then the API
        # server's calls get 404, and every JobSet is refused).
        self._until("jobset-controller", self._jobset_admitted, within)

    def _jobset_admitted(self) -> bool:
        """A JobSet passes the controller's webhooks, in a dry run."""
        with self.client() as api:
            r = api.post(
                "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets",
                params={"dryRun": "All"},
                json=ADMISSION_PROBE,
            )
        return r.status_code == 201

    def _start_kwok(self, within: float) -> None:
        """kwok with the node stages and pod-ready of its "fast" set (built beside it) and
        the pod stages of tests/kwok_pod_stages.yaml: the nodes labelled KWOK_NODE_LABEL
        are made Ready and kept so, their pods run until deleted, then end as a kubelet
        ends them."""
        port = free_port()
        self._start(
            "kwok",
            [
                "kwok",
                f"--kubeconfig={self.admin.kubeconfig}",
                f"--config={self._stages()}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-label-selector={KWOK_NODE_LABEL}={KWOK_NODE_VALUE}",
                f"--server-address=127.0.0.1:{port}",
            ],
        )
        self._until(
            "kwok", lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").is_success, within
        )

    def _stages(self) -> Path:
        fast = yaml.safe_load_all((self.bin / "kwok-stages" / "stages.yaml").read_text())
        ours = list(yaml.safe_load_all(POD_STAGES.read_text()))
        replaced = {doc["metadata"]["name"] for doc in ours}
        kept = [doc for doc in fast if doc and doc["metadata"]["name"] not in replaced]
        path = self.work / "kwok-stages.yaml"
        path.write_text(yaml.safe_dump_all([*kept, *(doc for doc in ours if doc)]))
        return path

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.procs.clear()

    # --- the API, as the admin -------------------------------------------------------------

    def client(self, identity: Identity | None = None) -> httpx.Client:
        """An HTTP client of the API server as `identity` (the admin by default)."""
        who = identity or self.admin
        user = yaml.safe_load(who.kubeconfig.read_text())["users"][0]["user"]
        context = ssl.create_default_context(cafile=str(self.work / "ca.crt"))
        if "client-key" in user:
            context.load_cert_chain(user["client-certificate"], user["client-key"])
        headers = {"Authorization": f"Bearer {user['token']}"} if "token" in user else {}
        return httpx.Client(base_url=self.url, verify=context, headers=headers, timeout=30)

    def apply(self, obj: dict[str, Any], *, strict: bool = False) -> dict[str, Any]:
        """Server-side apply of one object as the admin (field manager `tests`); `strict`:
        a field the server does not know of, or one given twice, is refused."""
        params = {"fieldManager": "tests", "force": "true"}
        if strict:
            params["fieldValidation"] = "Strict"
        with self.client() as http:
            r = http.patch(
                object_path(obj),
                params=params,
                content=yaml.safe_dump(obj),
                headers={"Content-Type": "application/apply-patch+yaml"},
            )
            if not r.is_success:
                raise ControlPlaneError(f"apply {obj['kind']} {obj['metadata']['name']}: {r.text}")
            return r.json()  # type: ignore[no-any-return]

    def apply_file(self, path: Path, drop_conversion: bool = False) -> None:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                if drop_conversion:
                    doc["spec"].pop("conversion", None)  # one version: nothing to convert
                self.apply(doc)


_CORE = {
    "Namespace",
    "Node",
    "Pod",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "Service",
    "PersistentVolume",
    "PersistentVolumeClaim",
}
_PLURAL = {
    "CustomResourceDefinition": ("apis/apiextensions.k8s.io/v1", "customresourcedefinitions"),
    "MutatingWebhookConfiguration": (
        "apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
    ),
    "ValidatingWebhookConfiguration": (
        "apis/admissionregistration.k8s.io/v1",
        "validatingwebhookconfigurations",
    ),
    "ClusterRole": ("apis/rbac.authorization.k8s.io/v1", "clusterroles"),
    "ClusterRoleBinding": ("apis/rbac.authorization.k8s.io/v1", "clusterrolebindings"),
    "Role": ("apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "JobSet": ("apis/jobset.x-k8s.io/v1alpha2", "jobsets"),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
    "Lease": ("apis/coordination.k8s.io/v1", "leases"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "DaemonSet": ("apis/apps/v1", "daemonsets"),
}
_CLUSTER_SCOPED = {
    "Namespace",
    "Node",
    "PersistentVolume",
    "CustomResourceDefinition",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "ClusterRole",
    "ClusterRoleBinding",
}


def object_path(obj: dict[str, Any]) -> str:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if kind in _CORE:
        group, plural = "api/v1", kind.lower() + "s"
    else:
        group, plural = _PLURAL[kind]
    if kind in _CLUSTER_SCOPED:
        return f"/{group}/{plural}/{name}"
    namespace = obj["metadata"].get("namespace", "default")
    return f"/{group}/namespaces/{namespace}/{plural}/{name}"
