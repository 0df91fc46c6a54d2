"""The local stack's NATS identities: one user per service and per node agent, a password each,
the server's authorization block, and the admin's env file for the CLI.

Passwords are random per stack start; the server config and the admin env file are written
owner-only under the state directory.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tessera import bus_permissions as bp
from tessera.settings import NatsSettings

ADMIN_ENV_NAME = "nats-admin.env"

# Which identity each service module connects as (kube-sim does not use the bus).
ROLE_OF_MODULE = {
    "tessera.admission": bp.ADMISSION,
    "tessera.scheduler": bp.SCHEDULER,
    "tessera.quota": bp.QUOTA,
    "tessera.metrics": bp.METRICS,
    "tessera.node_agent": bp.NODE_AGENT,
}


def identity_of(module: str, env: dict[str, str]) -> bp.Permissions | None:
    """The identity a stack child runs as, from its module (and node, for node agents)."""
    role = ROLE_OF_MODULE.get(module)
    if role is None:
        return None
    node = env.get("TESSERA_NODE_NAME") if role == bp.NODE_AGENT else None
    return bp.permissions(role, node)


@dataclass
class StackAuth:
    """Every identity of one stack with its password."""

    identities: list[bp.Permissions]
    passwords: dict[str, str]

    @classmethod
    def generate(cls, nodes: Iterable[str]) -> StackAuth:
        identities = bp.identities(nodes)
        return cls(identities, {p.user: secrets.token_urlsafe(24) for p in identities})

    def server_config(self) -> str:
        return bp.ServerAuth(
            [(p, bp.Credential(password=self.passwords[p.user])) for p in self.identities]
        ).render()

    def env(self, user: str) -> dict[str, str]:
        """NATS_USER / NATS_PASSWORD for a child process."""
        return {"NATS_USER": user, "NATS_PASSWORD": self.passwords[user]}

    def settings(self, url: str, role: str = bp.ADMIN, node: str | None = None) -> NatsSettings:
        user = bp.user_name(role, node)
        return NatsSettings(NATS_URL=url, NATS_USER=user, NATS_PASSWORD=self.passwords[user])

    def write_admin_env(self, path: Path, url: str) -> None:
        """An env file for the CLI: `TESSERA_ENV_FILE=<path> tessera quota set ...`."""
        admin = bp.user_name(bp.ADMIN)
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(
            f"NATS_URL={url}\nNATS_USER={admin}\nNATS_PASSWORD={self.passwords[admin]}\n"
        )
