"""Who may do what on the bus: one NATS identity per service (and per node agent), derived from
the names in tessera.bus, and the nats-server `authorization` block generated from it.

The table is the one source for the server config (`tessera nats-config`), the local stack's
users (tessera_cli.stack) and docs/security.md. Each role lists exactly the subjects it publishes
and subscribes to, including the JetStream API subjects behind what nats-py does for it:

- KV read: `$JS.API.STREAM.MSG.GET.KV_<bucket>` (or DIRECT.GET when the bucket allows it);
- KV watch: an ordered consumer, `$JS.API.CONSUMER.CREATE.KV_<bucket>`, its INFO and the
  flow-control replies `$JS.FC.KV_<bucket>.>`;
- KV write (put/create/update/delete) of a key: a publish to `$KV.<bucket>.<key>`;
- events: publish to the event's subject (the stream dedupes by Nats-Msg-Id), read through an
  ordered consumer, or a durable pull consumer (CREATE/INFO/MSG.NEXT and `$JS.ACK.` of its
  name);
- micro services: subscribe to the endpoint and to `$SRV.{PING,INFO,STATS}[.<name>[.<id>]]`,
  replies through `allow_responses` (no publish right to anyone's inbox);
- every identity gets its own inbox prefix `_INBOX.<user>.>` (tessera.bus.connect sets it), so
  nobody reads another identity's replies.

Nothing grants STREAM.DELETE/PURGE, MSG.DELETE or CONSUMER.DELETE: no service needs them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import get_args

from tessera import bus
from tessera.models import (
    AdmissionAction,
    AllocAction,
    ComputeAction,
    MemoryAction,
    MigAction,
    MpsAction,
    NodeAction,
    PreemptionAction,
    QuotaAction,
    RejectedKind,
)

JS_API = "$JS.API"
# Every stream a service may have to (re-)create: the buckets, the events, the clock.
STREAMS = bus.BUS_STREAMS
NODE_PLACEHOLDER = "<node>"
_DOC_NODE = "doc-node-placeholder"  # a valid name, shown as <node> in the table

# Role names (also the user names, prefixed with "tessera-"; node agents add their node).
ADMISSION = "admission"
SCHEDULER = "scheduler"
QUOTA = "quota"
METRICS = "metrics"
NODE_AGENT = "node-agent"
ADMIN = "admin"
EVENTS_READER = "events-reader"
SERVICE_ROLES = (ADMISSION, SCHEDULER, QUOTA, METRICS)
ROLES = (*SERVICE_ROLES, NODE_AGENT, ADMIN, EVENTS_READER)

# Durable consumers that belong to a service: nobody else may create, read or ack them.
SERVICE_DURABLES = (bus.QUOTA_RELEASED_CONSUMER,)

_ANY = "ANYTOKEN0"  # a token that subject_token leaves alone, replaced by '*'


def wildcard(subject_of: Callable[..., str], *args: str) -> str:
    """The subject pattern of a bus.py subject function with its name token as '*'."""
    return subject_of(_ANY, *args).replace(_ANY, "*")


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a KV put/delete of `key` publishes to (a literal: keys may contain dots)."""
    return f"$KV.{bucket}.{key}"


# A Kubernetes node name (DNS-1123 subdomain). Checked before a name becomes a permission: a
# node called '>' or '*' would otherwise be granted every node's keys.
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_node_name(node: str | None) -> str:
    if not node or len(node) > 253 or not _NODE_NAME.match(node):
        raise ValueError(f"not a Kubernetes node name: {node!r}")
    return node


def user_name(role: str, node: str | None = None) -> str:
    if role == NODE_AGENT:
        return f"tessera-node-{check_node_name(node)}"
    return f"tessera-{role}"


@dataclass(frozen=True)
class Rule:
    """One line of the table: what a role may do for one purpose."""

    purpose: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()


@dataclass(frozen=True)
class Permissions:
    """An identity's complete permissions, as nats-server enforces them."""

    user: str
    role: str
    rules: tuple[Rule, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    allow_responses: bool = False
    node: str | None = None

    @property
    def publish(self) -> list[str]:
        return _unique(s for r in self.rules for s in r.publish)

    @property
    def subscribe(self) -> list[str]:
        return _unique(s for r in self.rules for s in r.subscribe)

    def server_entry(self) -> dict[str, object]:
        """The `permissions` map of this user in nats-server's config."""
        publish: dict[str, list[str]] = {"allow": self.publish}
        if self.publish_deny:
            publish["deny"] = list(self.publish_deny)
        subscribe: dict[str, list[str]] = {"allow": self.subscribe}
        if self.subscribe_deny:
            subscribe["deny"] = list(self.subscribe_deny)
        entry: dict[str, object] = {"publish": publish, "subscribe": subscribe}
        if self.allow_responses:
            entry["allow_responses"] = True
        return entry


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


# --- building blocks --------------------------------------------------------------------------


def _bus_setup() -> Rule:
    # tessera.service.serve -> ensure_bus: look up, and create when missing, the buckets and the
    # stream (a create of an existing stream with another config is refused by the server).
    return Rule(
        "find or create the buckets and the event stream",
        publish=tuple(
            f"{JS_API}.STREAM.{verb}.{stream}" for stream in STREAMS for verb in ("INFO", "CREATE")
        ),
    )


def _server_clock() -> Rule:
    # tessera.clock.ServerClock: publish a tiny message, read the server's stamp on it back.
    # Its in-memory stream is found or created at start (bus.ensure_clock_stream).
    return Rule(
        "measure the NATS server's clock",
        publish=(
            f"{JS_API}.STREAM.INFO.{bus.CLOCK_STREAM}",
            f"{JS_API}.STREAM.CREATE.{bus.CLOCK_STREAM}",
            f"{bus.CLOCK_PREFIX}.*",
            f"{JS_API}.STREAM.MSG.GET.{bus.CLOCK_STREAM}",
            f"{JS_API}.DIRECT.GET.{bus.CLOCK_STREAM}",
            f"{JS_API}.DIRECT.GET.{bus.CLOCK_STREAM}.>",
        ),
    )


def _rejections(kinds: Iterable[str]) -> Rule:
    # tessera.validation.Rejections: a value that failed validation is reported, never applied.
    return Rule(
        "report values refused by validation",
        publish=tuple(bus.rejected_event_subject(k) for k in _checked(kinds, RejectedKind)),
    )


def _inbox(user: str) -> Rule:
    return Rule("replies to its own requests", subscribe=(f"{bus.inbox_prefix(user)}.>",))


def _kv_read(bucket: str) -> Rule:
    stream = kv_stream(bucket)
    return Rule(
        f"read {bucket}",
        publish=(
            f"{JS_API}.STREAM.MSG.GET.{stream}",
            f"{JS_API}.DIRECT.GET.{stream}",
            f"{JS_API}.DIRECT.GET.{stream}.>",
        ),
    )


def _kv_watch(bucket: str) -> Rule:
    stream = kv_stream(bucket)
    return Rule(
        f"watch {bucket}",
        publish=(
            f"{JS_API}.STREAM.MSG.GET.{stream}",
            f"{JS_API}.DIRECT.GET.{stream}",
            f"{JS_API}.DIRECT.GET.{stream}.>",
            f"{JS_API}.CONSUMER.CREATE.{stream}",
            f"{JS_API}.CONSUMER.INFO.{stream}.*",
            f"$JS.FC.{stream}.>",
        ),
    )


def _kv_write(bucket: str, key: str | None = None) -> Rule:
    if key is None:
        return Rule(f"write every key of {bucket}", publish=(kv_subject(bucket, ">"),))
    return Rule(f"write its own key of {bucket}", publish=(kv_subject(bucket, key),))


def _events_read() -> Rule:
    stream = bus.EVENTS_STREAM
    return Rule(
        "read the event stream (ordered consumer)",
        publish=(
            f"{JS_API}.STREAM.INFO.{stream}",
            f"{JS_API}.CONSUMER.CREATE.{stream}",
            f"{JS_API}.CONSUMER.INFO.{stream}.*",
            f"$JS.FC.{stream}.>",
        ),
    )


def _events_durable(name: str | None) -> Rule:
    """A durable pull consumer of the event stream named `name` (None: any name)."""
    stream = bus.EVENTS_STREAM
    token = name or "*"
    return Rule(
        f"durable consumer {name or '<any name>'} of the event stream",
        publish=(
            f"{JS_API}.CONSUMER.CREATE.{stream}.{token}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.{token}.>",
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{token}",
            f"{JS_API}.CONSUMER.INFO.{stream}.{token}",
            f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{token}",
            f"$JS.ACK.{stream}.{token}.>",
        ),
    )


def _service_durable_deny() -> tuple[str, ...]:
    stream = bus.EVENTS_STREAM
    out: list[str] = []
    for name in SERVICE_DURABLES:
        out += [
            f"{JS_API}.CONSUMER.CREATE.{stream}.{name}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.{name}.>",
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
            f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>",
        ]
    return tuple(out)


def _publish_events(purpose: str, subjects: Iterable[str]) -> Rule:
    return Rule(purpose, publish=tuple(subjects))


def _micro(service: str, endpoints: Iterable[str]) -> Rule:
    discovery = [
        f"$SRV.{verb}{suffix}"
        for verb in ("PING", "INFO", "STATS")
        for suffix in ("", f".{service}", f".{service}.*")
    ]
    return Rule(f"serve {service} (micro)", subscribe=(*endpoints, *discovery))


def _requests(purpose: str, *subjects: str) -> Rule:
    return Rule(purpose, publish=subjects)


def _checked(actions: Iterable[str], allowed: object) -> list[str]:
    names = list(actions)
    unknown = set(names) - set(get_args(allowed))
    if unknown:
        raise ValueError(f"not an event action: {sorted(unknown)}")
    return names


# --- the roles --------------------------------------------------------------------------------


def _rules(role: str, node: str | None) -> tuple[list[Rule], bool]:
    """(rules, allow_responses) of a role."""
    if role == SCHEDULER:
        alloc = _checked(["reserved", "bound", "released", "failed"], AllocAction)
        return [
            _bus_setup(),
            _kv_watch(bus.NODES_BUCKET),
            _kv_watch(bus.LEDGER_BUCKET),
            _kv_watch(bus.QUOTA_BUCKET),
            _kv_write(bus.LEDGER_BUCKET),
            _publish_events(
                "allocation events, lost nodes, scheduling failures, deleted pending pods",
                [wildcard(bus.alloc_event_subject, a) for a in alloc]
                + [wildcard(bus.node_event_subject, a)
                   for a in _checked(["lost"], NodeAction)]
                + [wildcard(bus.sched_failed_subject), wildcard(bus.sched_gone_subject)],
            ),
            _publish_events(
                "preemption started / done",
                [wildcard(bus.preemption_event_subject, a) for a in get_args(PreemptionAction)],
            ),
            Rule("usage samples: a victim's GPU memory is really free", subscribe=(bus.USAGE_ALL,)),
            _requests("reserve and release quota", bus.QUOTA_RESERVE, bus.QUOTA_RELEASE),
            _rejections(["registration", "ledger", "quota"]),
            _micro(bus.SCHEDULER_SERVICE, [bus.SCHEDULER_EXPLAIN]),
        ], True
    if role == QUOTA:
        return [
            _bus_setup(),
            _kv_watch(bus.QUOTA_BUCKET),
            _kv_write(bus.QUOTA_BUCKET),
            _kv_watch(bus.QUOTA_CHARGES_BUCKET),
            _kv_write(bus.QUOTA_CHARGES_BUCKET),
            _kv_watch(bus.LEDGER_BUCKET),
            # a running DRA pod's charge, rebuilt from its claims, needs its node's GPUs
            _kv_read(bus.NODES_BUCKET),
            _rejections(["event", "command"]),
            _events_durable(bus.QUOTA_RELEASED_CONSUMER),
            _publish_events(
                "quota events",
                [wildcard(bus.quota_event_subject, a) for a in get_args(QuotaAction)],
            ),
            _requests("probe its own endpoint (readiness)", bus.QUOTA_STATUS),
            _micro(
                bus.QUOTA_SERVICE,
                [bus.QUOTA_RESERVE, bus.QUOTA_RELEASE, bus.QUOTA_STATUS, bus.QUOTA_SET],
            ),
        ], True
    if role == ADMISSION:
        return [
            _bus_setup(),
            _publish_events(
                "admission events",
                [wildcard(bus.admission_event_subject, a) for a in get_args(AdmissionAction)],
            ),
            _requests("check quota before admitting", bus.QUOTA_RESERVE),
        ], False
    if role == METRICS:
        return [
            _bus_setup(),
            _kv_watch(bus.NODES_BUCKET),
            _kv_watch(bus.LEDGER_BUCKET),
            _kv_watch(bus.QUOTA_BUCKET),
            _events_read(),
            Rule("usage samples", subscribe=(bus.USAGE_ALL,)),
        ], False
    if role == NODE_AGENT:
        node = check_node_name(node)
        # failed: a dynamic MIG instance NVML refused (mig_service.py)
        alloc = _checked(["allocated", "mismatch", "failed"], AllocAction)
        node_actions = _checked(
            ["registered", "unhealthy", "configured", "config_refused"], NodeAction
        )
        return [
            _bus_setup(),
            _kv_read(bus.NODES_BUCKET),
            _kv_watch(bus.LEDGER_BUCKET),  # elastic memory: guarantees from its ledger entry
            _kv_write(bus.NODES_BUCKET, node),
            _kv_write(bus.LEDGER_BUCKET, node),
            _publish_events(
                "its own node's events",
                [bus.alloc_event_subject(node, a) for a in alloc]
                + [bus.node_event_subject(node, a) for a in node_actions]
                + [bus.oom_event_subject(node), bus.limit_breached_subject(node)]
                + [bus.mig_event_subject(node, a) for a in get_args(MigAction)]
                + [bus.mps_event_subject(node, a) for a in _checked(["started", "stopped"],
                                                                    MpsAction)]
                + [bus.memory_event_subject(node, a) for a in get_args(MemoryAction)]
                + [bus.compute_event_subject(node, a) for a in get_args(ComputeAction)],
            ),
            _requests("resize a pod's quota charge with its limits", bus.QUOTA_RESERVE),
            _rejections(["ledger", "limits", "command"]),
            Rule("its own usage samples", publish=(bus.usage_subject(node),)),
            _micro(bus.NODE_SERVICE, [bus.node_limits_subject(node),
                                      bus.node_config_set_subject(node),
                                      bus.node_config_get_subject(node)]),
        ], True
    if role == ADMIN:
        return [
            Rule(
                "inspect and manage streams (no delete, no purge)",
                publish=(
                    f"{JS_API}.INFO",
                    *(f"{JS_API}.STREAM.{verb}.{s}" for s in (*STREAMS, bus.CLOCK_STREAM)
                      for verb in ("INFO", "CREATE", "UPDATE")),
                    f"{JS_API}.STREAM.LIST",
                    f"{JS_API}.STREAM.NAMES",
                    *(f"{JS_API}.CONSUMER.{verb}.{s}" for s in STREAMS
                      for verb in ("LIST", "NAMES")),
                ),
            ),
            _kv_watch(bus.NODES_BUCKET),
            _kv_watch(bus.LEDGER_BUCKET),
            _kv_watch(bus.QUOTA_BUCKET),
            _events_read(),
            _events_durable(None),
            _requests(
                "set quotas, change limits and node configs, ask why a pod is pending",
                bus.QUOTA_SET,
                bus.QUOTA_STATUS,
                wildcard(bus.node_limits_subject),
                wildcard(bus.node_config_set_subject),
                wildcard(bus.node_config_get_subject),
                bus.SCHEDULER_EXPLAIN,
                "$SRV.>",
            ),
            Rule("usage samples", subscribe=(bus.USAGE_ALL,)),
        ], False
    if role == EVENTS_READER:
        return [_events_read(), _events_durable(None)], False
    raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")


def permissions(role: str, node: str | None = None) -> Permissions:
    """The permissions of one identity (node agents: of the agent of `node`)."""
    user = user_name(role, node)
    rules, allow_responses = _rules(role, node)
    rules = [*rules, _inbox(user)]
    # tessera.service.serve keeps a ServerClock; the admin's CLI stamps its signed commands'
    # expiry on the same clock (tessera_cli/signed.py).
    if role in (*SERVICE_ROLES, NODE_AGENT, ADMIN):
        rules.append(_server_clock())
    deny = _service_durable_deny() if role in (ADMIN, EVENTS_READER) else ()
    return Permissions(
        user=user,
        role=role,
        rules=tuple(rules),
        publish_deny=deny,
        allow_responses=allow_responses,
        node=node if role == NODE_AGENT else None,
    )


def identities(nodes: Iterable[str]) -> list[Permissions]:
    """Every identity of a cluster with these GPU nodes."""
    out = [permissions(role) for role in (*SERVICE_ROLES, ADMIN, EVENTS_READER)]
    out += [permissions(NODE_AGENT, node) for node in nodes]
    return out


# --- rendering --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Credential:
    """How one identity proves itself: a password, or a reference nats-server resolves from its
    environment (`$VAR`), so the config itself holds no secret."""

    password: str | None = None
    env_var: str | None = None

    def render(self) -> str:
        if self.env_var:
            return f"${self.env_var}"
        if self.password is None:
            raise ValueError("a credential needs a password or an env var")
        return json.dumps(self.password)


def password_env_var(user: str) -> str:
    """The env var name nats-server reads a user's password from (`--passwords env`)."""
    safe = "".join(ch if ch.isalnum() else "_" for ch in user.upper())
    return f"{safe}_PASSWORD"


@dataclass
class ServerAuth:
    """The authorization block: every identity with its credential."""

    users: list[tuple[Permissions, Credential]] = field(default_factory=list)

    def render(self) -> str:
        lines = [
            "# Generated by `tessera nats-config` from tessera/bus_permissions.py; do not edit.",
            "# No user without a password: anonymous clients are refused.",
            "authorization {",
            "  users = [",
        ]
        for perms, credential in self.users:
            lines.append(f"    {{  # {perms.role}" + (f" on {perms.node}" if perms.node else ""))
            lines.append(f"      user: {json.dumps(perms.user)}")
            lines.append(f"      password: {credential.render()}")
            lines.append(f"      permissions: {_conf_value(perms.server_entry(), 6)}")
            lines.append("    }")
        lines += ["  ]", "}", ""]
        return "\n".join(lines)


def _conf_value(value: object, indent: int) -> str:
    """nats-server config syntax (JSON-like: quoted strings, maps, lists)."""
    pad = " " * indent
    if isinstance(value, dict):
        items = [f"{pad}  {k}: {_conf_value(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + "\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list):
        if not value:
            return "[]"
        items = [f"{pad}  {json.dumps(v)}" for v in value]
        return "[\n" + "\n".join(items) + f"\n{pad}]"
    return json.dumps(value)


def consumer_streams(perms: Permissions) -> list[str]:
    """The streams this identity may create consumers on (any kind: nats-server does not check
    what a consumer's config asks, its deliver subject included)."""
    out = []
    for subject in perms.publish:
        for prefix in (f"{JS_API}.CONSUMER.CREATE.", f"{JS_API}.CONSUMER.DURABLE.CREATE."):
            if subject.startswith(prefix):
                out.append(subject[len(prefix):].split(".", 1)[0])
    return _unique(out)


def stored_streams(perms: Permissions) -> list[str]:
    """The streams this identity may put a message of its own into (a KV key, an event, the
    clock): what it could have a consumer deliver somewhere."""
    out = []
    for subject in perms.publish:
        if subject.startswith("$KV."):
            out.append(kv_stream(subject.split(".")[1]))
        elif subject.startswith(f"{bus.EVENTS_PREFIX}."):
            out.append(bus.EVENTS_STREAM)
        elif subject.startswith(f"{bus.CLOCK_PREFIX}."):
            out.append(bus.CLOCK_STREAM)
    return _unique(out)


def relay_table() -> str:
    """Per identity: where it may store messages and create consumers. A push consumer delivers
    to whatever subject its creator names, so these are the parts of a relay; signed commands
    (tessera.signing) are what refuses one."""
    rows = ["| identity | may store messages in | may create consumers on |", "|---|---|---|"]
    for perms in identities([_DOC_NODE]):
        stored = "<br>".join(f"`{s}`" for s in stored_streams(perms)) or "-"
        consumers = "<br>".join(f"`{s}`" for s in consumer_streams(perms)) or "-"
        rows.append(f"| `{perms.user}` | {stored} | {consumers} |")
    return ("\n".join(rows) + "\n").replace(_DOC_NODE, NODE_PLACEHOLDER)


def markdown_table() -> str:
    """The permission table of docs/security.md: one row per role and purpose."""
    rows = [
        "| identity | for | publish | subscribe |",
        "|---|---|---|---|",
    ]
    for perms in identities([_DOC_NODE]):
        for rule in perms.rules:
            pub = "<br>".join(f"`{s}`" for s in rule.publish) or "-"
            sub = "<br>".join(f"`{s}`" for s in rule.subscribe) or "-"
            rows.append(f"| `{perms.user}` | {rule.purpose} | {pub} | {sub} |")
        extra = []
        if perms.allow_responses:
            extra.append("answers requests it receives (`allow_responses`)")
        if perms.publish_deny:
            extra.append("denied: " + "<br>".join(f"`{s}`" for s in perms.publish_deny))
        if extra:
            rows.append(f"| `{perms.user}` | {'; '.join(extra)} | | |")
    return ("\n".join(rows) + "\n").replace(_DOC_NODE, NODE_PLACEHOLDER)
