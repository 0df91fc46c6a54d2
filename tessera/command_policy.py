"""Who may send which command, for which object: the receivers' rule after the signature.

Pure. `authorize` answers a refusal (text) or None; for quota reservations it may also name a
pod the receiver must find in the cluster (`PodCheck`) before acting: a reservation is only ever
for a pod that exists (and, from a node agent, that runs on that agent's own node).

| command | who may send it |
|---|---|
| `tessera.quota.set` | the admin identity |
| `tessera.quota.reserve` (check only) | scheduler, admission, admin |
| `tessera.quota.reserve` (hold) | scheduler, for a pod that exists; a node agent, for a pod |
|   | bound to its own node (it resizes the charge with `limits.set`) |
| `tessera.quota.release` | scheduler |
| `tessera.node.<node>.limits.set` | the admin identity |
| `tessera.node.<node>.config.set` | the admin identity |
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera import bus
from tessera import bus_permissions as bp

# The state-changing request/reply endpoints (read-only ones: quota.status, config.get,
# scheduler.explain). Node subjects are matched by their last tokens.
QUOTA_COMMANDS = (bus.QUOTA_RESERVE, bus.QUOTA_RELEASE, bus.QUOTA_SET)
NODE_COMMAND_SUFFIXES = (".limits.set", ".config.set")

ADMIN_USER = bp.user_name(bp.ADMIN)
SCHEDULER_USER = bp.user_name(bp.SCHEDULER)
ADMISSION_USER = bp.user_name(bp.ADMISSION)
_NODE_PREFIX = "tessera-node-"


def is_command(subject: str) -> bool:
    return subject in QUOTA_COMMANDS or (
        subject.startswith("tessera.node.") and subject.endswith(NODE_COMMAND_SUFFIXES)
    )


def node_of(user: str) -> str | None:
    """The node a node agent's identity belongs to (None: not a node agent)."""
    return user[len(_NODE_PREFIX):] if user.startswith(_NODE_PREFIX) else None


@dataclass(frozen=True)
class PodCheck:
    """The receiver must find this pod in the cluster (uid included), bound to `node` if set."""

    namespace: str
    name: str
    uid: str
    node: str | None = None


def authorize_quota(
    subject: str, sender: str, *, namespace: str, pod_uid: str, name: str, check_only: bool
) -> str | PodCheck | None:
    """None: allowed; PodCheck: allowed if that pod exists; text: refused."""
    if subject == bus.QUOTA_SET:
        if sender == ADMIN_USER:
            return None
        return f"{sender or 'an unnamed sender'} may not set quotas"
    if subject == bus.QUOTA_RELEASE:
        if sender == SCHEDULER_USER:
            return None
        return f"{sender or 'an unnamed sender'} may not release quota charges"
    if subject == bus.QUOTA_RESERVE:
        if check_only:
            if sender in (SCHEDULER_USER, ADMISSION_USER, ADMIN_USER):
                return None
            return f"{sender or 'an unnamed sender'} may not ask quota questions"
        if sender == SCHEDULER_USER:
            return PodCheck(namespace, name, pod_uid)
        node = node_of(sender)
        if node:
            return PodCheck(namespace, name, pod_uid, node)
        return f"{sender or 'an unnamed sender'} may not hold quota for pods"
    return f"{subject} is not a quota command"


def authorize_node(subject: str, sender: str, node: str) -> str | None:
    """limits.set / config.set of `node`: the admin only."""
    if subject not in (bus.node_limits_subject(node), bus.node_config_set_subject(node)):
        return f"{subject} is not a command of node {node}"
    if sender == ADMIN_USER:
        return None
    return f"{sender or 'an unnamed sender'} may not send {subject.rsplit('.', 2)[-2]}.set"


def pod_problem(check: PodCheck, pod: dict | None) -> str | None:
    """Why the pod named in a reservation does not qualify (None: it does)."""
    who = f"{check.namespace}/{check.name}"
    if pod is None:
        return f"pod {who} does not exist in the cluster"
    meta = pod.get("metadata") or {}
    if check.uid and meta.get("uid") != check.uid:
        return f"pod {who} has uid {meta.get('uid')!r}, not {check.uid!r}"
    if check.node is not None:
        bound = (pod.get("spec") or {}).get("nodeName")
        if bound != check.node:
            return f"pod {who} runs on {bound or 'no node'}, not on {check.node}"
    return None
