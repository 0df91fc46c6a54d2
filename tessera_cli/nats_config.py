"""`tessera nats-config`: the nats-server authorization block for a cluster, from the one
permission table (tessera/bus_permissions.py), and the Secrets that go with it.

    tessera nats-config --node gpu-1 --node gpu-2             # the block, passwords as $VARs
    tessera nats-config --node gpu-1 --out nats-auth/         # + passwords, Secrets for Helm
    tessera nats-config --table                               # the permission table (markdown)
    tessera nats-config --out a/ --password-files creds/ --owner 65532:65532   # docker compose

With `--password-files DIR`, each identity's password also goes to `DIR/<user>/password`
(one directory per identity, so a container can mount its own and nobody else's; read it with
NATS_PASSWORD_FILE), owned by `--owner` when given.

With `--out`, passwords are generated once and kept in `<out>/passwords.json` (0600): running
again with more nodes adds their identities and keeps every existing password. Each identity's
command-signing key (docs/security.md 4.6) is kept the same way in `<out>/command-keys.json`;
its Secret carries it as `command-key`, and Secret `tessera-command-trust` (`trust.json`, also
written to `<out>/trust.json`) holds every public key. With `--password-files`, the key goes to
`<dir>/<user>/command.key` beside the password (a node's host directory holds both).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from pathlib import Path

import typer
import yaml

from tessera import bus_permissions as bp
from tessera import signing

PASSWORDS_FILE = "passwords.json"
KEYS_FILE = "command-keys.json"
TRUST_FILE = "trust.json"
TRUST_SECRET = "tessera-command-trust"
AUTH_FILE = "auth.conf"
SECRETS_FILE = "secrets.yaml"


def secret_name(perms: bp.Permissions) -> str:
    """The Kubernetes Secret a chart reads an identity's credentials from."""
    if perms.node is not None:
        return f"tessera-nats-node-{perms.node}"
    return f"tessera-nats-{perms.role}"


def env_reference_config(nodes: list[str]) -> str:
    """The block with every password as an env reference nats-server resolves at start."""
    users = [
        (p, bp.Credential(env_var=bp.password_env_var(p.user))) for p in bp.identities(nodes)
    ]
    return bp.ServerAuth(users).render()


def load_passwords(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise typer.BadParameter(f"{path}: expected a JSON object of user -> password")
    return data


def _write_private(path: Path, text: str) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)


def load_keys(path: Path) -> dict[str, str]:
    """user -> PEM private key (command signing), as kept in command-keys.json."""
    return load_passwords(path)


def _keys(pems: dict[str, str]) -> dict[str, object]:
    from cryptography.hazmat.primitives import serialization

    return {u: serialization.load_pem_private_key(p.encode(), password=None)
            for u, p in pems.items()}  # fmt: skip


def secrets_manifest(identities: list[bp.Permissions], passwords: dict[str, str],
                     namespace: str, keys: dict[str, str] | None = None) -> str:
    keys = keys or {}
    docs = []
    for perms in identities:
        docs.append({
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": secret_name(perms),
                "namespace": namespace,
                "labels": {"app.kubernetes.io/part-of": "tessera",
                           "tessera.io/nats-role": perms.role},
            },
            "data": {
                "user": base64.b64encode(perms.user.encode()).decode(),
                "password": base64.b64encode(passwords[perms.user].encode()).decode(),
                **({"command-key": base64.b64encode(keys[perms.user].encode()).decode()}
                   if perms.user in keys else {}),
            },
        })
    if keys:
        docs.append({
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": TRUST_SECRET, "namespace": namespace,
                         "labels": {"app.kubernetes.io/part-of": "tessera"}},
            "data": {TRUST_FILE: base64.b64encode(
                signing.trust_text(_keys(keys)).encode()).decode()},  # type: ignore[arg-type]
        })
    return yaml.safe_dump_all(docs, sort_keys=False)


def write_bundle(out: Path, nodes: list[str], namespace: str) -> list[bp.Permissions]:
    """auth.conf (passwords inline, for the NATS server), secrets.yaml (one Secret per
    identity, for Tessera's namespace) and passwords.json (kept for the next run)."""
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    identities = bp.identities(nodes)
    passwords = load_passwords(out / PASSWORDS_FILE)
    for perms in identities:
        passwords.setdefault(perms.user, secrets.token_urlsafe(24))
    _write_private(out / PASSWORDS_FILE, json.dumps(passwords, indent=2, sort_keys=True))
    keys = load_keys(out / KEYS_FILE)
    for perms in identities:
        if perms.user not in keys:
            keys[perms.user] = signing.private_pem(signing.new_key()).decode()
    _write_private(out / KEYS_FILE, json.dumps(keys, indent=2, sort_keys=True))
    (out / TRUST_FILE).write_text(signing.trust_text(_keys(keys)))  # type: ignore[arg-type]
    config = bp.ServerAuth(
        [(p, bp.Credential(password=passwords[p.user])) for p in identities]
    ).render()
    _write_private(out / AUTH_FILE, config)
    _write_private(out / SECRETS_FILE,
                   secrets_manifest(identities, passwords, namespace, keys))
    return identities


def parse_owner(owner: str) -> tuple[int, int]:
    """`UID[:GID]` -> (uid, gid); the gid defaults to the uid."""
    uid, _, gid = owner.partition(":")
    try:
        return int(uid), int(gid or uid)
    except ValueError:
        raise typer.BadParameter(
            f"expected UID[:GID], got {owner!r}", param_hint="--owner"
        ) from None


def write_password_files(directory: Path, identities: list[bp.Permissions],
                         passwords: dict[str, str], owner: tuple[int, int] | None,
                         keys: dict[str, str] | None = None) -> None:
    """`<directory>/<user>/password` (0400) per identity: one mount per service."""
    keys = keys or {}
    for perms in identities:
        user_dir = directory / perms.user
        user_dir.mkdir(parents=True, exist_ok=True)
        path = user_dir / "password"
        if path.exists():
            path.chmod(0o600)
        _write_private(path, passwords[perms.user] + "\n")
        path.chmod(0o400)
        targets = [user_dir, path]
        if perms.user in keys:  # its command-signing key and the trust file, beside the password
            key_path = user_dir / "command.key"
            if key_path.exists():
                key_path.chmod(0o600)
            _write_private(key_path, keys[perms.user])
            key_path.chmod(0o400)
            trust_path = user_dir / TRUST_FILE
            if trust_path.exists():
                trust_path.chmod(0o644)
            trust_path.write_text(signing.trust_text(_keys(keys)))  # type: ignore[arg-type]
            trust_path.chmod(0o444)
            targets += [key_path, trust_path]
        if owner is not None:
            for target in targets:
                os.chown(target, *owner)


def register(app: typer.Typer) -> None:
    @app.command("nats-config")
    def nats_config_command(
        node: list[str] = typer.Option(
            [], "--node", help="a GPU node's name (repeat; each gets its own node-agent user)"
        ),
        out: Path | None = typer.Option(
            None, "--out", help="write auth.conf, secrets.yaml and passwords.json here"
        ),
        namespace: str = typer.Option(
            "tessera-system", "--namespace", help="namespace of the Secrets in secrets.yaml"
        ),
        table: bool = typer.Option(False, "--table", help="print the permission table only"),
        password_files: Path | None = typer.Option(
            None, "--password-files",
            help="with --out: also write each password to <dir>/<user>/password",
        ),
        owner: str | None = typer.Option(
            None, "--owner", help="UID[:GID] that owns the --password-files (a container user)"
        ),
    ) -> None:
        """Print nats-server's authorization block: one user per Tessera service and per node
        agent, each limited to the subjects it needs."""
        if table:
            typer.echo(bp.markdown_table(), nl=False)
            return
        if len(set(node)) != len(node):
            raise typer.BadParameter("a node is named twice", param_hint="--node")
        if password_files is not None and out is None:
            raise typer.BadParameter("needs --out", param_hint="--password-files")
        if out is None:
            typer.echo(env_reference_config(node), nl=False)
            return
        identities = write_bundle(out, node, namespace)
        if password_files is not None:
            passwords = load_passwords(out / PASSWORDS_FILE)
            write_password_files(password_files, identities, passwords,
                                 parse_owner(owner) if owner else None,
                                 load_keys(out / KEYS_FILE))
        typer.echo(f"{len(identities)} identities; wrote {out / AUTH_FILE} (include it in the "
                   f"NATS server's config) and {out / SECRETS_FILE} (kubectl apply -f it).")
