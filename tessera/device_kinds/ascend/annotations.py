"""HAMi's Ascend annotations, keyed by a chip's commonWord (`Ascend910B3`). Pure.

Facts from HAMi (`pkg/device/ascend`, the ascend-device-plugin's register/allocate; their docs):

- `hami.io/node-register-<cw>` (node, the device plugin = node agent): JSON list of devices
  `{id, index, count, devmem, devcore, type, numa, health, customInfo}`; `customInfo.NetworkID`
  on 910: HCCS ring 0 for NPUs 0-3, 1 for 4-7 (910C: all 0).
- `hami.io/node-handshake-<cw>` (node, device plugin): `Reported_<2006.01.02 15:04:05>`.
- `hami.io/use-<cw>-uuid`, `hami.io/no-use-<cw>-uuid` (pod, user): NPU UUIDs to use / not use.
- `hami.io/<cw>-devices-to-allocate`, `hami.io/<cw>-devices-allocated` (pod, scheduler): HAMi's
  device list (`UUID,TYPE,MEM,CORES:` per device, `;` per container).
- `huawei.com/<cw>` (pod, scheduler): JSON `[{"UUID": …, "temp": "<template>"}]` ("" = whole
  NPU), what the device plugin turns into `ASCEND_VNPU_SPECS`.
- `huawei.com/vnpu-mode` (pod, user): `hami-core` = HAMi's soft split (not Tessera's: refused).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from .chips import AscendChip

VNPU_MODE = "huawei.com/vnpu-mode"
VNPU_MODE_HAMI_CORE = "hami-core"
HANDSHAKE_TIME_FORMAT = "%Y.%m.%d %H:%M:%S"
NETWORK_ID = "NetworkID"


def register_key(common_word: str) -> str:
    return f"hami.io/node-register-{common_word}"


def handshake_key(common_word: str) -> str:
    return f"hami.io/node-handshake-{common_word}"


def use_uuid_key(common_word: str) -> str:
    return f"hami.io/use-{common_word}-uuid"


def no_use_uuid_key(common_word: str) -> str:
    return f"hami.io/no-use-{common_word}-uuid"


def to_allocate_key(common_word: str) -> str:
    return f"hami.io/{common_word}-devices-to-allocate"


def allocated_key(common_word: str) -> str:
    return f"hami.io/{common_word}-devices-allocated"


def runtime_info_key(common_word: str) -> str:
    return f"huawei.com/{common_word}"


def pod_keys(chip: AscendChip) -> tuple[str, ...]:
    """Every pod annotation of this chip type (user knobs and scheduler-owned)."""
    cw = chip.common_word
    return (use_uuid_key(cw), no_use_uuid_key(cw), to_allocate_key(cw), allocated_key(cw),
            runtime_info_key(cw))


def scheduler_owned_keys(chip: AscendChip) -> tuple[str, ...]:
    cw = chip.common_word
    return to_allocate_key(cw), allocated_key(cw), runtime_info_key(cw)


def network_id(chip: AscendChip, index: int) -> int | None:
    """HAMi's HCCS ring of a 910 NPU (910C: one ring); None for other chips."""
    if not chip.common_word.startswith("Ascend910"):
        return None
    if chip.module_pairs:
        return 0
    return 0 if index <= 3 else 1


@dataclass(frozen=True)
class RegisteredNpu:
    """One NPU as `hami.io/node-register-<cw>` lists it."""

    uuid: str
    index: int
    count: int  # vNPUs the chip may hold (HAMi: the plugin's vdevice count)
    memory_mib: int
    ai_core: int
    type: str
    healthy: bool
    numa: int = 0
    network: int | None = None
    mode: str = ""


def encode_register(npus: list[RegisteredNpu]) -> str:
    items: list[dict[str, Any]] = []
    for n in npus:
        item: dict[str, Any] = {"id": n.uuid, "index": n.index, "count": n.count,
                                "devmem": n.memory_mib, "devcore": n.ai_core, "type": n.type,
                                "numa": n.numa, "health": n.healthy}
        if n.mode:
            item["mode"] = n.mode
        if n.network is not None:
            item["customInfo"] = {NETWORK_ID: n.network}
        items.append(item)
    return json.dumps(items, separators=(",", ":"))


def decode_register(text: str) -> list[RegisteredNpu]:
    """ValueError naming the problem when the annotation is not HAMi's JSON list."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"node-register: invalid JSON: {exc}") from exc
    if not isinstance(items, list):
        raise ValueError("node-register: expected a JSON list")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise ValueError(f"node-register: item {i} has no string \"id\"")
        custom = item.get("customInfo") or {}
        try:
            out.append(RegisteredNpu(
                uuid=item["id"], index=int(item.get("index", i)), count=int(item.get("count", 0)),
                memory_mib=int(item.get("devmem", 0)), ai_core=int(item.get("devcore", 0)),
                type=str(item.get("type", "")), healthy=bool(item.get("health", False)),
                numa=int(item.get("numa", 0)), mode=str(item.get("mode") or ""),
                network=int(custom[NETWORK_ID]) if NETWORK_ID in custom else None,
            ))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"node-register: item {i}: {exc}") from exc
    return out


def handshake_value(now: float | None = None) -> str:
    return "Reported_" + time.strftime(HANDSHAKE_TIME_FORMAT, time.localtime(now))


def encode_runtime_info(grants: list[tuple[str, str]]) -> str:
    """`huawei.com/<cw>`: (uuid, template) per granted NPU, HAMi's `[{"UUID", "temp"}]`."""
    return json.dumps([{"UUID": u, "temp": t} if t else {"UUID": u} for u, t in grants],
                      separators=(",", ":"))


def decode_runtime_info(text: str) -> dict[str, str]:
    """uuid → template ('' = whole NPU); ValueError when malformed."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"runtime info: invalid JSON: {exc}") from exc
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("UUID"), str) for i in items
    ):
        raise ValueError("runtime info: expected a list of {\"UUID\": …, \"temp\": …}")
    return {i["UUID"]: str(i.get("temp") or "") for i in items}


def uuid_selection(annotations: dict[str, str], common_word: str) -> tuple[frozenset[str],
                                                                           frozenset[str]]:
    """(use, no-use) UUID sets from the pod's annotations (empty: no constraint)."""
    def split(key: str) -> frozenset[str]:
        return frozenset(u.strip() for u in (annotations.get(key) or "").split(",") if u.strip())

    return split(use_uuid_key(common_word)), split(no_use_uuid_key(common_word))
