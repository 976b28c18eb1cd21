"""The container runtime of the test kubelet (tests/kube_real_kubelet.py): a pod's one
container run as a plain process on this machine.

- **The process.** The container's `command` + `args`, run as one process (its own
  session, output appended to `<log_dir>/<pod>.log`). The environment is the container's
  `env` as the kubelet builds it: `value`s with `$(VAR)` expanded from the variables
  before them (`$$` escapes), `fieldRef` (the downward API: `metadata.name`,
  `.namespace`, `.uid`, `.labels['k']`, `.annotations['k']`, `spec.nodeName`,
  `spec.serviceAccountName`, `status.hostIP`, `status.podIP`), `secretKeyRef` read
  through the function given; plus `JOB_COMPLETION_INDEX` from the pod's completion
  index annotation, and `HOSTNAME`. `command`/`args` get the same `$(VAR)` expansion.
- **What a container cannot see here.** There is no image and no filesystem isolation:
  the process runs this interpreter (`python` on PATH is `sys.executable`'s), with the
  repository on PYTHONPATH, and paths in the env must be host paths (the test points
  the shared and per-node directories at its temporary directory). `HOST_MONITOR_URL`,
  when the container sets it, is replaced by the URL of the host monitor of the pod's
  node: what the node-local Service (internalTrafficPolicy Local) resolves to.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


@dataclass
class Container:
    """One pod's process."""

    pod: str
    uid: str
    node: str
    proc: subprocess.Popen[bytes]
    log: Path
    grace_s: float
    term_sent: float | None = None
    reported: bool = False
    exit_code: int | None = None


def container_process(
    pod: dict[str, Any], secret: Callable[[str, str], str], host_monitor_url: str
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the pod's one container, as the kubelet builds them
    (`secret(name, key)` reads a Secret's key), with this machine's interpreter and the
    repository on the path."""
    m, spec = pod["metadata"], pod.get("spec") or {}
    (container,) = spec.get("containers") or []  # one container per worker pod
    env: dict[str, str] = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "HOME": os.environ.get("HOME", "/"),
        "HOSTNAME": spec.get("hostname") or m["name"],
    }
    index = (m.get("annotations") or {}).get(COMPLETION_INDEX)
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = index
    for var in container.get("env") or []:
        env[var["name"]] = _value(var, pod, env, secret)
    if "HOST_MONITOR_URL" in env:
        env["HOST_MONITOR_URL"] = host_monitor_url
    argv = [
        _expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])
    ]
    return argv, env


def launch(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """The container's process: a session of its own, output appended to `log`."""
    cwd.mkdir(exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _value(
    var: dict[str, Any],
    pod: dict[str, Any],
    env: dict[str, str],
    secret: Callable[[str, str], str],
) -> str:
    if "value" in var:
        return _expand(str(var["value"]), env)
    source = var.get("valueFrom") or {}
    if "fieldRef" in source:
        return _field(pod, source["fieldRef"]["fieldPath"])
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return secret(ref["name"], ref["key"])
    raise ValueError(f"env {var['name']}: unsupported source {sorted(source)}")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables only, `$$` -> `$`."""

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    return _VAR.sub(one, text)


def _field(pod: dict[str, Any], path: str) -> str:
    m = pod["metadata"]
    found = _FIELD.match(path)
    if found:
        return str((m.get(found[1]) or {}).get(found[2], ""))
    simple = {
        "metadata.name": m.get("name"),
        "metadata.namespace": m.get("namespace"),
        "metadata.uid": m.get("uid"),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
        "status.hostIP": (pod.get("status") or {}).get("hostIP"),
        "status.podIP": (pod.get("status") or {}).get("podIP"),
    }
    if path not in simple:
        raise ValueError(f"fieldRef {path!r} is not supported")
    return str(simple[path] or "")


def kill_group(pid: int) -> None:
    """SIGKILL the process group of `pid` (the container's session), if still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
