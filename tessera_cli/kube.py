"""A small Kubernetes REST client for the CLI: the server, TLS and credentials of a kubeconfig,
JSON over the standard library's HTTP (cheap to import; `tessera get pods` starts fast).

Errors come back as `ApiError` with one readable line: the API server's own message for a
refused request, "cannot reach ..." when nothing answers (within a few seconds).
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .locate import CliError

# A read that takes longer than this means the server is not there (or stuck): say so.
READ_TIMEOUT_S = 6.0


class ApiError(CliError):
    """A request the API server refused, or could not be asked."""

    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass
class KubeConfig:
    server: str
    ca_file: str | None = None
    insecure: bool = False
    token: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    path: Path | None = None
    _temporary: list[str] = field(default_factory=list)


def _data_file(entry: dict[str, Any], key: str, scratch: list[str]) -> str | None:
    """`<key>` (a path) or `<key>-data` (base64) as a file path."""
    if entry.get(key):
        return str(entry[key])
    data = entry.get(f"{key}-data")
    if not data:
        return None
    handle = tempfile.NamedTemporaryFile(prefix="tessera-kube-", delete=False)  # noqa: SIM115
    with handle:
        handle.write(base64.b64decode(data))
    scratch.append(handle.name)
    return handle.name


def load_kubeconfig(path: Path) -> KubeConfig:
    """The current context's cluster and user; ApiError naming the file when it is unusable."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ApiError(f"{path}: unreadable kubeconfig: {exc}") from None
    if not isinstance(config, dict):
        raise ApiError(f"{path}: not a kubeconfig")
    current = config.get("current-context")
    contexts = {c.get("name"): c.get("context") or {} for c in config.get("contexts") or []}
    clusters = {c.get("name"): c.get("cluster") or {} for c in config.get("clusters") or []}
    users = {u.get("name"): u.get("user") or {} for u in config.get("users") or []}
    context = contexts.get(current, {}) if current else {}
    cluster = clusters.get(context.get("cluster")) if context else None
    if cluster is None:
        cluster = next(iter(clusters.values()), None)
    if not cluster or not cluster.get("server"):
        raise ApiError(f"{path}: no cluster server in the kubeconfig")
    user = users.get(context.get("user"), {}) if context else {}
    scratch: list[str] = []
    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    return KubeConfig(
        server=str(cluster["server"]).rstrip("/"),
        ca_file=_data_file(cluster, "certificate-authority", scratch),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=token,
        client_cert=_data_file(user, "client-certificate", scratch),
        client_key=_data_file(user, "client-key", scratch),
        path=path,
        _temporary=scratch,
    )


class KubeClient:
    """GET/POST/PUT/PATCH/DELETE JSON against one API server."""

    def __init__(self, config: KubeConfig, timeout_s: float = 30.0) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self._context: ssl.SSLContext | None = None
        # the API server's `Warning: 299 - "<text>"` headers, in order (the caller prints them)
        self.warnings: list[str] = []
        if config.server.startswith("https"):
            context = ssl.create_default_context(cafile=config.ca_file)
            if config.insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if config.client_cert:
                context.load_cert_chain(config.client_cert, config.client_key)
            self._context = context

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *_: object) -> None:
        for name in self.config._temporary:
            Path(name).unlink(missing_ok=True)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.config.server + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        if self.config.token:
            request.add_header("Authorization", f"Bearer {self.config.token}")
        try:
            timeout = self.timeout_s if method != "GET" else min(self.timeout_s, READ_TIMEOUT_S)
            with urllib.request.urlopen(request, timeout=timeout, context=self._context) as reply:
                self._keep_warnings(reply.headers)
                raw = reply.read()
        except urllib.error.HTTPError as error:
            self._keep_warnings(error.headers)
            raise self._refusal(error) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ApiError(
                f"cannot reach the API server at {self.config.server} ({reason}): is the stack "
                "running (`tessera up`)?"
            ) from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise ApiError(f"{method} {path}: the API server's reply is not JSON") from None

    def _keep_warnings(self, headers: Any) -> None:
        for value in headers.get_all("Warning") or []:
            head, sep, rest = value.partition('"')
            if sep and head.strip().startswith("299") and rest.endswith('"'):
                self.warnings.append(rest[:-1].replace('\\"', '"').replace("\\\\", "\\"))

    def take_warnings(self) -> list[str]:
        taken, self.warnings = self.warnings, []
        return taken

    @staticmethod
    def _refusal(error: urllib.error.HTTPError) -> ApiError:
        text = error.read().decode("utf-8", "replace")
        try:
            status = json.loads(text)
        except ValueError:
            status = {}
        message = status.get("message") if isinstance(status, dict) else None
        reason = status.get("reason", "") if isinstance(status, dict) else ""
        return ApiError(message or f"HTTP {error.code}: {text.strip()[:300]}", error.code, reason)

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, "application/merge-patch+json")

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)


def api_client(state_dir: Path | None, kubeconfig: Path | None) -> KubeClient:
    """The client every command uses (rules in tessera_cli.locate)."""
    from .locate import StackLocation

    path = StackLocation.find(state_dir).kubeconfig(kubeconfig)
    return KubeClient(load_kubeconfig(path))
