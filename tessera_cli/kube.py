"""A small Kubernetes REST client for the CLI: the server, TLS and credentials of a kubeconfig,
JSON over the standard library's HTTP (cheap to import; `tessera get pods` starts fast).

A GET from a plain-HTTP server (kube-sim under `tessera up`) is one HTTP/1.1 exchange on a socket
(`_plain_get`): urllib, http.client and ssl are imported only for anything else, which is most of
what a `tessera get pods` would otherwise spend importing (bench/get_pods_vs_kubectl.py).

Errors come back as `ApiError` with one readable line: the API server's own message for a
refused request, "cannot reach ..." when nothing answers (within a few seconds).
"""

from __future__ import annotations

import base64
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

from .locate import CliError

# A read that takes longer than this means the server is not there (or stuck): say so.
READ_TIMEOUT_S = 6.0
# A kept-alive connection idle this long is opened anew (servers close idle ones: uvicorn
# after 5 s) rather than risk a request on one the server is closing.
IDLE_REOPEN_S = 2.0


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
    try:
        text = path.read_text()
    except OSError as exc:
        raise ApiError(f"{path}: unreadable kubeconfig: {exc}") from None
    try:  # JSON is YAML: a kubeconfig in JSON (kube-sim's) needs no YAML parser
        config = json.loads(text)
    except ValueError:
        import yaml

        try:
            config = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
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
        self._connection: Any = None  # http.client's, kept alive between requests
        self._used_at = 0.0
        self._prefix = ""
        if config.server.startswith("https"):
            import ssl

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
        self._close_connection()
        for name in self.config._temporary:
            Path(name).unlink(missing_ok=True)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        headers = {"Accept": "application/json"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        timeout = self.timeout_s if method != "GET" else min(self.timeout_s, READ_TIMEOUT_S)
        try:
            if method == "GET" and self.config.server.startswith("http://") and not _proxied():
                status, raw = _plain_get(self.config.server, path, headers, timeout)
                if status >= 400:
                    raise _refused(status, raw.decode("utf-8", "replace"))
            elif _proxied():
                raw = self._urllib(method, path, body, content_type, headers, timeout)
            else:
                raw = self._kept_alive(method, path, body, content_type, headers, timeout)
        except OSError as error:  # urllib's URLError is one
            reason = getattr(error, "reason", None) or error
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

    def _kept_alive(self, method: str, path: str, body: Any, content_type: str,
                    headers: dict[str, str], timeout: float) -> bytes:  # fmt: skip
        """A write (or an https GET) on the client's one kept-alive connection, as kubectl's
        transport reuses its connection: `tessera apply` of many objects makes one connection,
        not one per object. A connection idle for `IDLE_REOPEN_S` is opened anew (the server
        may be closing it); an idempotent request on a reused connection the server had closed
        is sent once more on a new one, never a POST (it may have been done)."""
        import http.client

        data = json.dumps(body).encode() if body is not None else None
        sent = {**headers, "Content-Type": content_type} if data is not None else headers
        for attempt in (0, 1):
            reused = self._connection is not None
            connection = self._connection_for(timeout)
            try:
                connection.request(method, self._prefix + path, body=data, headers=sent)
                reply = connection.getresponse()
                raw: bytes = reply.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._close_connection()
                if attempt or not reused or method == "POST":
                    raise
                continue
            except http.client.HTTPException as exc:  # a reply that is not HTTP
                self._close_connection()
                raise OSError(f"not an HTTP reply: {exc!r}"[:200]) from None
            except BaseException:
                self._close_connection()
                raise
            self._used_at = time.monotonic()
            if reply.will_close:
                self._close_connection()
            self._keep_warnings(reply.headers)
            if reply.status >= 400:
                raise _refused(reply.status, raw.decode("utf-8", "replace"))
            return raw
        raise AssertionError("unreachable")

    def _connection_for(self, timeout: float) -> Any:
        import http.client
        from urllib.parse import urlsplit

        if self._connection is not None and time.monotonic() - self._used_at > IDLE_REOPEN_S:
            self._close_connection()
        if self._connection is None:
            url = urlsplit(self.config.server)
            if url.scheme == "https":
                self._connection = http.client.HTTPSConnection(
                    url.hostname or "127.0.0.1", url.port or 443, timeout=timeout,
                    context=self._context)  # fmt: skip
            else:
                self._connection = http.client.HTTPConnection(
                    url.hostname or "127.0.0.1", url.port or 80, timeout=timeout)  # fmt: skip
            self._prefix = url.path.rstrip("/")
        self._connection.timeout = timeout
        if self._connection.sock is not None:
            self._connection.sock.settimeout(timeout)
        return self._connection

    def _close_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _urllib(self, method: str, path: str, body: Any, content_type: str,
                headers: dict[str, str], timeout: float) -> bytes:  # fmt: skip
        import urllib.error
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.config.server + path, data=data, method=method,
                                         headers=headers)  # fmt: skip
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._context) as reply:
                self._keep_warnings(reply.headers)
                raw: bytes = reply.read()
                return raw
        except urllib.error.HTTPError as error:
            self._keep_warnings(error.headers)
            raise _refused(error.code, error.read().decode("utf-8", "replace")) from None

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


def _refused(code: int, text: str) -> ApiError:
    """The API server's refusal: its Status message and reason, else the status line."""
    try:
        status = json.loads(text)
    except ValueError:
        status = {}
    message = status.get("message") if isinstance(status, dict) else None
    reason = status.get("reason", "") if isinstance(status, dict) else ""
    return ApiError(message or f"HTTP {code}: {text.strip()[:300]}", code, reason)


def _proxied() -> bool:
    """An HTTP proxy is configured: urllib's path, which honours it (and NO_PROXY)."""
    import os

    return any(os.environ.get(name) for name in ("http_proxy", "HTTP_PROXY", "all_proxy",
                                                  "ALL_PROXY"))  # fmt: skip


def _plain_get(server: str, path: str, headers: dict[str, str], timeout: float
               ) -> tuple[int, bytes]:  # fmt: skip
    """One HTTP/1.1 GET on a socket to an `http://` server: (status, body). The body is read as
    the reply frames it (Content-Length, chunked, else until the server closes); OSError when
    the server is away or the reply is not HTTP."""
    import socket
    from urllib.parse import urlsplit

    from tessera.quantity import is_plain_digits

    url = urlsplit(server + path)
    target = (url.path or "/") + (f"?{url.query}" if url.query else "")
    lines = [f"GET {target} HTTP/1.1", f"Host: {url.netloc}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        with sock.makefile("rb") as reply:
            status_line = reply.readline(65537).decode("latin-1")
            parts = status_line.split(" ", 2)
            # ASCII digits only: str.isdigit takes '²' (int() refuses it) and '١٢' (int() reads it)
            if (len(parts) < 2 or not parts[0].startswith("HTTP/") or len(parts[1].strip()) != 3
                    or not is_plain_digits(parts[1].strip())):
                raise OSError(f"not an HTTP reply: {status_line.strip()[:80]!r}")
            fields: dict[str, str] = {}
            while (line := reply.readline(65537).decode("latin-1").strip()):
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
            if "chunked" in fields.get("transfer-encoding", "").lower():
                body = _dechunked(reply)
            elif "content-length" in fields:
                if not is_plain_digits(fields["content-length"]):
                    raise OSError(f"bad Content-Length {fields['content-length'][:40]!r}")
                body = reply.read(int(fields["content-length"]))
            else:
                body = reply.read()
    return int(parts[1]), body


def _dechunked(reply: Any) -> bytes:
    chunks = []
    while True:
        size_line = reply.readline(65537).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise OSError("malformed chunked reply") from None
        if size == 0:
            return b"".join(chunks)
        chunks.append(reply.read(size))
        reply.readline(3)  # the CRLF after the chunk


def api_client(state_dir: Path | None, kubeconfig: Path | None) -> KubeClient:
    """The client every command uses (rules in tessera_cli.locate)."""
    from .locate import StackLocation

    path = StackLocation.find(state_dir).kubeconfig(kubeconfig)
    return KubeClient(load_kubeconfig(path))
