"""Which supervisor the commands talk to, and with which token.

From flags, else environment variables, else a context of the config file, shaped like
a kubeconfig::

    current-context: prod
    contexts:
    - name: prod
      server: https://supervisor.example.com
      token-file: ~/.secrets/supervisor-operator-token
      certificate-authority: ~/.secrets/supervisor-ca.crt
      tls-server-name: resiliency-supervisor.training.svc  # through a port-forward
    - name: local
      server: http://127.0.0.1:8080
      token: ...

A context's token is only ever sent to that context's server: a `--server` or
`SUPERVISOR_URL` pointing elsewhere does not pick it up (nor its certificate-authority,
the CA bundle that verifies an https:// server, default the system's trust store, nor its
tls-server-name, the name the server's certificate is checked against instead of the
URL's host).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.ops.errors import CliError, ExitCode

CONFIG_ENV = "SUPERVISOR_CONFIG"
SERVER_ENV = "SUPERVISOR_URL"
#: The variable `supervisor serve` reads its operator token from: one shell can run both.
TOKEN_ENV = "SUPERVISOR_OPERATOR_TOKEN"
#: The CA bundle (PEM) that verifies an https:// server.
CA_ENV = "SUPERVISOR_CA_FILE"


def default_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "resiliency-supervisor" / "config.yaml"


def config_path(flag: str | None) -> tuple[Path, bool]:
    """The config file, and whether it was named (by flag or env) rather than defaulted."""
    named = flag or os.environ.get(CONFIG_ENV)
    return (Path(named).expanduser(), True) if named else (default_config_path(), False)


def _usage(message: str) -> CliError:
    return CliError(message, ExitCode.USAGE)


def check_server(server: str) -> str:
    if not server.startswith(("http://", "https://")):
        raise _usage(f"server {server!r}: give an http:// or https:// URL")
    return server.rstrip("/")


@dataclass(frozen=True, slots=True)
class Context:
    name: str
    server: str
    token: str | None = None
    token_file: str | None = None
    certificate_authority: str | None = None
    tls_server_name: str | None = None

    def ca_path(self, config_dir: Path) -> str | None:
        """certificate-authority, relative to the config file as kubeconfig paths are."""
        if self.certificate_authority is None:
            return None
        return str(config_dir / Path(self.certificate_authority).expanduser())

    def read_token(self, config_dir: Path) -> str | None:
        if self.token is not None:
            return self.token
        if self.token_file is None:
            return None
        # Relative to the config file, as kubeconfig paths are.
        path = config_dir / Path(self.token_file).expanduser()
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise _usage(
                f"context {self.name!r}: cannot read token-file {path}: {exc.strerror}"
            ) from None

    def to_yaml(self) -> dict[str, str]:
        out = {"name": self.name, "server": self.server}
        if self.token is not None:
            out["token"] = self.token
        if self.token_file is not None:
            out["token-file"] = self.token_file
        if self.certificate_authority is not None:
            out["certificate-authority"] = self.certificate_authority
        if self.tls_server_name is not None:
            out["tls-server-name"] = self.tls_server_name
        return out


@dataclass
class ConfigFile:
    path: Path
    current_context: str | None = None
    contexts: list[Context] = field(default_factory=list)
    #: Keys this CLI does not use, kept when the file is rewritten.
    other: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, *, must_exist: bool) -> ConfigFile:
        try:
            raw = path.read_text()
        except FileNotFoundError:
            if must_exist:
                raise _usage(f"config file not found: {path}") from None
            return cls(path)
        except OSError as exc:
            raise _usage(f"cannot read {path}: {exc.strerror}") from None
        import yaml  # here: a call without a config file reads none

        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            detail = " ".join(str(exc).split())
            raise _usage(f"{path}: not valid YAML: {detail}") from None
        if data is None:
            return cls(path)
        if not isinstance(data, dict):
            raise _usage(f"{path}: expected a mapping with current-context and contexts")
        return cls(
            path,
            _optional_str(data.get("current-context"), path, "current-context"),
            [_context(entry, path, i) for i, entry in enumerate(data.get("contexts") or [])],
            {k: v for k, v in data.items() if k not in ("current-context", "contexts")},
        )

    def find(self, name: str) -> Context:
        for context in self.contexts:
            if context.name == name:
                return context
        raise _usage(f"no context {name!r} in {self.path}")

    def put(self, context: Context) -> None:
        """Add the context, or replace the one of that name in place."""
        for i, existing in enumerate(self.contexts):
            if existing.name == context.name:
                self.contexts[i] = context
                return
        self.contexts.append(context)

    def save(self) -> None:
        data: dict[str, Any] = {
            "current-context": self.current_context,
            "contexts": [c.to_yaml() for c in self.contexts],
            **self.other,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Tokens live here: written private (mkstemp creates 0600), and replaced whole
        # so that a crash never leaves half a file.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".config-", suffix=".yaml")
        try:
            with os.fdopen(fd, "w") as out:
                import yaml

                yaml.safe_dump(data, out, sort_keys=False)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _optional_str(value: Any, path: Path, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _usage(f"{path}: {where} must be a string")


def _context(entry: Any, path: Path, index: int) -> Context:
    where = f"contexts[{index}]"
    if not isinstance(entry, dict):
        raise _usage(f"{path}: {where} must be a mapping")
    name = entry.get("name")
    server = entry.get("server")
    if not isinstance(name, str) or not name:
        raise _usage(f"{path}: {where} needs a name")
    if not isinstance(server, str) or not server:
        raise _usage(f"{path}: context {name!r} needs a server")
    token = _optional_str(entry.get("token"), path, f"context {name!r}: token")
    token_file = _optional_str(entry.get("token-file"), path, f"context {name!r}: token-file")
    if token is not None and token_file is not None:
        raise _usage(f"{path}: context {name!r}: give token or token-file, not both")
    ca = _optional_str(
        entry.get("certificate-authority"), path, f"context {name!r}: certificate-authority"
    )
    server_name = _optional_str(
        entry.get("tls-server-name"), path, f"context {name!r}: tls-server-name"
    )
    return Context(name, server, token, token_file, ca, server_name)


@dataclass(frozen=True, slots=True)
class Connection:
    server: str
    token: str | None
    #: The CA bundle that verifies an https:// server; None: the system's trust store.
    ca_file: str | None = None
    #: The name its certificate is checked against; None: the URL's host.
    tls_server_name: str | None = None


def resolve(
    *,
    server: str | None,
    token: str | None,
    context: str | None,
    config: str | None,
    ca_file: str | None = None,
    tls_server_name: str | None = None,
) -> Connection:
    """Flags over environment over the context (`--context`, else current-context).

    The config file is read only when the flags and environment leave something open,
    so a broken file does not stop `--server ... --token ...`.
    """
    server = server or os.environ.get(SERVER_ENV) or None
    token = token or os.environ.get(TOKEN_ENV) or None
    ca_file = ca_file or os.environ.get(CA_ENV) or None
    if server is not None and token is not None and context is None:
        return Connection(check_server(server), token, ca_file, tls_server_name)
    path, named = config_path(config)
    file = ConfigFile.load(path, must_exist=named or context is not None)
    chosen: Context | None = None
    if context is not None:
        chosen = file.find(context)
    elif file.current_context is not None and server is None:
        chosen = file.find(file.current_context)
    elif file.current_context is not None:
        # Only its token could matter, and only if it is for this very server.
        chosen = next((c for c in file.contexts if c.name == file.current_context), None)
    if server is None:
        if chosen is None:
            raise _usage(
                f"no server: give --server, set {SERVER_ENV}, or add a context to {path} "
                "(supervisor config set-context)"
            )
        server = chosen.server
    server = check_server(server)
    if chosen is not None and chosen.server.rstrip("/") == server:
        if token is None:
            token = chosen.read_token(path.parent)
        if ca_file is None:
            ca_file = chosen.ca_path(path.parent)
        if tls_server_name is None:
            tls_server_name = chosen.tls_server_name
    return Connection(server, token, ca_file, tls_server_name)
