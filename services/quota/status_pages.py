"""`tessera.quota.status` replies that fit in one NATS message (pure).

nats-server refuses a message over its `max_payload` (1 MiB unless raised), and the status of
every namespace grows with them: at 10,000 namespaces with a limit each the reply encoded to
1.28 MB, its publish failed, and every caller (`tessera quota list`, the service's own
readiness probe) saw only a timeout ("is it running?"). So a reply is bounded:

- every namespace: pages, in namespace order. A page holds whole namespaces (its state and its
  DRA device quotas) up to the byte budget, or `limit` of them; `continue_after` names its last
  namespace when more follow (ask again with `after` set to it, as kube's list `continue`), and
  the reason says how many were left out. The CLI follows the pages.
- one namespace: every charge while they fit; past the budget the newest charges fill it and the
  others are counted in the state's totals (`settled`): `used()` and `pods()` stay exact, and
  the reason says how many charges are listed of how many.
"""

from __future__ import annotations

from collections.abc import Iterable

from tessera.quota.arithmetic import add_usage

from tessera.codec import encode
from tessera.models import DeviceQuota, QuotaState

ENVELOPE_BYTES = 16 << 10  # the reply's own fields and the reason, with room to spare
_ITEM_OVERHEAD = 8  # a list item's framing in msgpack, generously


def budget_for(max_payload: int) -> int:
    """The bytes a reply's states and device quotas may take under the server's max_payload."""
    return max(4096, max_payload - ENVELOPE_BYTES)


def page(
    states: Iterable[QuotaState], device_quotas: Iterable[DeviceQuota], *, after: str = "",
    limit: int = 0, budget: int,
) -> tuple[list[QuotaState], list[DeviceQuota], str, int]:
    """The namespaces after `after`, in order, as many as fit `budget` bytes (and `limit`, when
    not 0): (states, device quotas, continue_after or "", how many namespaces were left out).
    A first namespace that does not fit alone is still given (`bounded` cuts it first)."""
    by_ns: dict[str, tuple[QuotaState | None, list[DeviceQuota]]] = {}
    for state in states:
        if state.namespace > after:
            by_ns[state.namespace] = (state, [])
    for quota in device_quotas:
        if quota.namespace > after:
            by_ns.setdefault(quota.namespace, (None, []))[1].append(quota)
    order = sorted(by_ns)
    out_states: list[QuotaState] = []
    out_quotas: list[DeviceQuota] = []
    used = 0
    taken = 0
    for namespace in order:
        state, quotas = by_ns[namespace]
        size = sum(len(encode(q)) + _ITEM_OVERHEAD for q in quotas)
        if state is not None:
            state = bounded(state, budget)[0]
            size += len(encode(state)) + _ITEM_OVERHEAD
        if taken and (used + size > budget or (limit and taken >= limit)):
            break
        used += size
        taken += 1
        if state is not None:
            out_states.append(state)
        out_quotas.extend(quotas)
    left = len(order) - taken
    return out_states, out_quotas, (order[taken - 1] if left else ""), left


def bounded(state: QuotaState, budget: int) -> tuple[QuotaState, int]:
    """`state` with as many of its charges as fit `budget` bytes, newest first kept; the others
    counted in `settled` (totals unchanged). Returns it and how many charges were left out."""
    if len(encode(state)) <= budget:
        return state, 0
    empty = state.model_copy(update={"charges": {}})
    room = budget - len(encode(empty)) - 64  # the totals may grow by a few bytes
    kept: dict[str, object] = {}
    settled = state.settled.model_copy()
    for uid, charge in sorted(state.charges.items(), key=lambda kv: (-kv[1].at, kv[0])):
        size = len(encode(charge)) + len(uid) + _ITEM_OVERHEAD
        if size <= room:
            kept[uid] = charge
            room -= size
            continue
        room = -1  # keep newest-first contiguous: once one is out, the older are out too
        add_usage(settled, charge, +1)
    left = len(state.charges) - len(kept)
    return state.model_copy(update={"charges": kept, "settled": settled}), left
