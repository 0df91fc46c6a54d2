"""The local stack's NATS identities: one user per service and per node agent, a password each,
the server's authorization block, and the admin's env file for the CLI.

Passwords are random per stack start; the server config and the admin env file are written
owner-only under the state directory.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tessera import bus_permissions as bp
from tessera import signing
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
    # Each identity's command-signing key (tessera.signing), and where they were written.
    keys: dict[str, Ed25519PrivateKey] = field(default_factory=dict)
    keys_dir: Path | None = None

    @classmethod
    def generate(cls, nodes: Iterable[str]) -> StackAuth:
        identities = bp.identities(nodes)
        return cls(identities, {p.user: secrets.token_urlsafe(24) for p in identities},
                   {p.user: signing.new_key() for p in identities})  # fmt: skip

    def write_keys(self, directory: Path) -> None:
        """`<dir>/<user>.pem` (0600) per identity and `<dir>/trust.json`: every service trusts
        every identity's public key; what each may send is the receiver's rule."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        for user, key in self.keys.items():
            path = directory / f"{user}.pem"
            path.touch(mode=0o600, exist_ok=True)
            path.chmod(0o600)
            path.write_bytes(signing.private_pem(key))
        (directory / "trust.json").write_text(signing.trust_text(self.keys))
        self.keys_dir = directory

    def signer(self, role: str = bp.ADMIN, node: str | None = None) -> signing.Signer:
        """How a test signs commands as `role` (the services read their keys from files)."""
        user = bp.user_name(role, node)
        return signing.Signer(user, self.keys.get(user))

    def command_env(self, user: str) -> dict[str, str]:
        """TESSERA_COMMAND_KEY_FILE / _TRUST_FILE of an identity (empty before write_keys)."""
        if self.keys_dir is None or user not in self.keys:
            return {}
        return {"TESSERA_COMMAND_KEY_FILE": str(self.keys_dir / f"{user}.pem"),
                "TESSERA_COMMAND_TRUST_FILE": str(self.keys_dir / "trust.json")}  # fmt: skip

    def server_config(self) -> str:
        return bp.ServerAuth(
            [(p, bp.Credential(password=self.passwords[p.user])) for p in self.identities]
        ).render()

    def env(self, user: str) -> dict[str, str]:
        """NATS_USER / NATS_PASSWORD for a child process."""
        return {"NATS_USER": user, "NATS_PASSWORD": self.passwords[user],
                **self.command_env(user)}  # fmt: skip

    def settings(self, url: str, role: str = bp.ADMIN, node: str | None = None) -> NatsSettings:
        user = bp.user_name(role, node)
        return NatsSettings(NATS_URL=url, NATS_USER=user, NATS_PASSWORD=self.passwords[user])

    def write_admin_env(self, path: Path, url: str) -> None:
        """An env file for the CLI: `TESSERA_ENV_FILE=<path> tessera quota set ...`."""
        admin = bp.user_name(bp.ADMIN)
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        keys = "".join(f"{k}={v}\n" for k, v in self.command_env(admin).items())
        path.write_text(
            f"NATS_URL={url}\nNATS_USER={admin}\nNATS_PASSWORD={self.passwords[admin]}\n{keys}"
        )
