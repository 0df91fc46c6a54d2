"""Who sent a request: bearer tokens mapped to users, as kube-apiserver's token authenticators do.

kube-apiserver authenticates every request and hands the user to admission as
`request.userInfo` (username, uid, groups). A service account's token authenticates as
`system:serviceaccount:<namespace>:<name>` in the groups `system:serviceaccounts`,
`system:serviceaccounts:<namespace>` and `system:authenticated`; a static-token user as its name,
its listed groups and `system:authenticated`. A request with no token is `system:anonymous` in
`system:unauthenticated`; a token nobody issued is refused with 401 Unauthorized.

kube-sim issues one token per client, each in its own kubeconfig: the CLI and kubectl as an admin
user (`kube-sim-admin`, `system:masters`), a tenant user, and one service account per Tessera
component in `tessera-system` (the chart's names). Tokens are kept in a file beside the
kubeconfig so a restarted kube-sim still accepts the kubeconfigs its clients hold (as a
`--token-auth-file`).
"""

from __future__ import annotations

import contextvars
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AUTHENTICATED = "system:authenticated"
COMPONENT_NAMESPACE = "tessera-system"


@dataclass(frozen=True)
class UserInfo:
    username: str
    groups: tuple[str, ...] = ()
    uid: str = ""

    def review(self) -> dict[str, Any]:
        """The AdmissionReview's `userInfo`."""
        info: dict[str, Any] = {"username": self.username, "groups": list(self.groups)}
        if self.uid:
            info["uid"] = self.uid
        return info


def service_account(namespace: str, name: str) -> UserInfo:
    return UserInfo(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


def static_user(name: str, *groups: str) -> UserInfo:
    return UserInfo(name, (*groups, AUTHENTICATED))


ANONYMOUS = UserInfo("system:anonymous", ("system:unauthenticated",))
# kube-sim's own loops (controllers creating pods) act as kube-controller-manager's accounts.
CONTROLLER = service_account("kube-system", "replicaset-controller")

# client name -> the user its kubeconfig authenticates as; "admin" is the main kubeconfig.
CLIENTS: dict[str, UserInfo] = {
    "admin": static_user("kube-sim-admin", "system:masters"),
    "tenant": static_user("tenant"),
    **{
        component: service_account(COMPONENT_NAMESPACE, f"tessera-{component}")
        for component in ("scheduler", "node-agent", "admission", "quota", "metrics")
    },
}
# The well-known admin token of kubeconfigs written without a token table (tests) and of
# kubeconfig-compose.yaml (the host's CLI against the compose stack): always the admin, who may do
# nothing in kube-sim that an anonymous client may not (no RBAC) and whom the webhook does not
# trust with the allocation's annotations.
LEGACY_TOKEN = "kube-sim"


@dataclass
class TokenTable:
    """token -> user; `issued` keeps client name -> token for writing kubeconfigs."""

    issued: dict[str, str] = field(default_factory=dict)

    @classmethod
    def legacy(cls) -> TokenTable:
        """An API server built without a table (tests) knows the legacy token as admin."""
        return cls({"admin": LEGACY_TOKEN})

    @classmethod
    def load_or_create(cls, path: Path) -> TokenTable:
        """The tokens in `path`, adding a fresh random one for each client it lacks."""
        issued: dict[str, str] = {}
        try:
            stored = json.loads(path.read_text())
            if isinstance(stored, dict):
                issued = {k: v for k, v in stored.items() if k in CLIENTS and isinstance(v, str)}
        except (OSError, ValueError):
            pass
        missing = [client for client in CLIENTS if not issued.get(client)]
        for client in missing:
            issued[client] = secrets.token_urlsafe(32)
        if missing:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.tmp")
            temporary.write_text(json.dumps(issued, indent=2) + "\n")
            os.chmod(temporary, 0o600)
            os.replace(temporary, path)
        return cls(issued)

    def user(self, authorization: str | None) -> UserInfo | None:
        """The user a request's Authorization header names; None for a token nobody issued."""
        if not authorization:
            return ANONYMOUS
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        if secrets.compare_digest(LEGACY_TOKEN, token.strip()):
            return CLIENTS["admin"]
        for client, issued in self.issued.items():
            if secrets.compare_digest(issued, token.strip()):
                return CLIENTS[client]
        return None


_current: contextvars.ContextVar[UserInfo] = contextvars.ContextVar(
    "kube_sim_user", default=CONTROLLER
)


def current_user() -> UserInfo:
    """The user of the HTTP request being served (kube-sim's own loops: a controller)."""
    return _current.get()


UNAUTHORIZED = json.dumps({
    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
    "message": "Unauthorized", "reason": "Unauthorized", "code": 401,
}).encode()


class Authentication:
    """ASGI middleware: the request's user set for its handlers, 401 for an unknown token."""

    def __init__(self, app: Any, tokens: TokenTable) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next(
            (v.decode("latin-1") for k, v in scope.get("headers") or [] if k == b"authorization"),
            None,
        )
        user = self.tokens.user(header)
        if user is None:
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(UNAUTHORIZED)).encode())]})
            await send({"type": "http.response.body", "body": UNAUTHORIZED})
            return
        token = _current.set(user)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)
