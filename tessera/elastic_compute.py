"""Elastic compute: a GPU's idle compute lent to its busy containers, in proportion to their shares.

A container sealed with a compute guarantee and a higher burst limit (limits 1.2,
`region.device_limit`) is *elastic*: libvgpu limits its launches to the allowance the node agent
seals for it (`DeviceLimit.sm_allow_x100`, % x 100), clamped to guarantee..burst. The tenant cannot
write that file (its directory is mounted read-only), so it cannot raise its own allowance; all it
can do to its own region is look busy, which earns it no more than its weighted fair share.

The policy (`lend_compute`, pure): on one GPU,

* an idle container keeps its guarantee as its allowance: when it wakes it may launch at its
  guaranteed rate at once, before anyone reacts;
* the whole device is shared among the busy containers in proportion to their guarantees
  (weighted fair share), none above its burst limit (a hard slice's burst is its guarantee), what
  a capped container cannot take going to the others (water-filling); never below a guarantee.

With every container busy each is held to its guarantee; with only one busy it gets the card up
to its burst. `ComputeLender.tick` applies it: it reads who is busy from each container's region
(`last_kernel_ns`, which libvgpu refreshes on every throttled launch, while a launch waits for
budget and while launches are in flight) and rewrites a limits file only when its allowance
changed. The node agent runs it every `LEND_INTERVAL_S` for the GPUs that hold an elastic
container (`services/node-agent/lending.py`); libvgpu picks a new file up within 20 ms and drops
what it banked at the old rate, so a neighbour that wakes has its share back within ~100 ms.

What this does not do: a busy container using less than its allowance keeps it (lending follows
who is busy, not how much each uses); a container with no compute limit on the same GPU is not
counted (it takes what it takes, as without elasticity).
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tessera.region import (
    MAX_DEVICES,
    REGION_MAGIC,
    SM_ALLOW_FULL,
    UUID_LEN,
    VERSION_MAJOR,
    ContainerLimits,
    DeviceLimit,
    RegionC,
    RegionDeviceC,
    RegionFormatError,
    decode_limits,
    set_device_flags,
)

LEND_INTERVAL_S = 0.02  # how often the node agent recomputes the allowances of an elastic GPU
IDLE_AFTER_S = 0.2  # no launch, no wait for budget, nothing in flight for this long: idle


@dataclass(frozen=True)
class ComputeClaim:
    """One container on one GPU, as the lending policy sees it."""

    key: str
    guarantee_pct: int  # 1..99
    burst_pct: int  # guarantee..100 (= guarantee: a hard slice, nothing lent)
    busy: bool


def lend_compute(claims: Sequence[ComputeClaim]) -> dict[str, int]:
    """key -> allowance (% x 100) on one GPU: weighted fair share of the whole device among the
    busy containers, each capped at its burst and never below its guarantee; idle containers
    keep their guarantee (pure)."""
    out = {c.key: c.guarantee_pct * 100 for c in claims}
    open_ = [c for c in claims if c.busy and c.guarantee_pct > 0]
    left = SM_ALLOW_FULL
    while open_:
        weight = sum(c.guarantee_pct for c in open_)
        capped = [c for c in open_ if left * c.guarantee_pct >= weight * _cap(c)]
        if not capped:
            break
        for c in capped:
            out[c.key] = _cap(c)
            left -= out[c.key]
        open_ = [c for c in open_ if c not in capped]
    if open_:
        weight = sum(c.guarantee_pct for c in open_)
        shares = {c.key: max(left, 0) * c.guarantee_pct // weight for c in open_}
        # the units floor division left over go to the largest shares first (sum <= the device)
        spare = max(left, 0) - sum(shares.values())
        for c in sorted(open_, key=lambda c: -c.guarantee_pct)[:spare]:
            shares[c.key] += 1
        for c in open_:
            out[c.key] = max(shares[c.key], c.guarantee_pct * 100)
    return out


def _cap(c: ComputeClaim) -> int:
    return min(max(c.burst_pct, c.guarantee_pct), 100) * 100


# ---- reading who is busy, cheaply (the lender runs every 20 ms) ------------------------------

_DEVICE_TABLE_END = RegionC.procs.offset
_DEV0 = RegionC.dev.offset
_DEV_SIZE = ctypes.sizeof(RegionDeviceC)
_HEAD = struct.Struct(f"<IH{RegionC.num_devices.offset - 6}xI")
_ACTIVITY = struct.Struct(
    f"<{UUID_LEN}s{RegionDeviceC.last_kernel_ns.offset - UUID_LEN}xQ"
)


def read_device_activity(path: str | os.PathLike[str]) -> dict[str, int]:
    """uuid -> last_kernel_ns (CLOCK_REALTIME ns; 0 = never) from a container's region; {} when
    absent, not initialised or damaged (an unreadable region reads as idle: its container keeps
    its guarantee, it is simply lent nothing)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_DEVICE_TABLE_END)
    except OSError:
        return {}
    if len(data) < _DEVICE_TABLE_END:
        return {}
    magic, major, num = _HEAD.unpack_from(data, 0)
    if magic != REGION_MAGIC or major != VERSION_MAJOR:
        return {}
    out = {}
    for i in range(min(num, MAX_DEVICES)):
        uuid, last = _ACTIVITY.unpack_from(data, _DEV0 + i * _DEV_SIZE)
        out[uuid.split(b"\0", 1)[0].decode(errors="replace")] = last
    return out


@dataclass(frozen=True)
class LendingMember:
    """A container on a GPU the lender watches: where its limits and its region are (host paths)."""

    key: str
    limits_dir: Path
    region_path: Path


@dataclass(frozen=True)
class ComputeTaken:
    """One reclaim: a busy elastic container's allowance lowered because neighbours on its GPU
    woke (or arrived), the compute it had been lent going to them."""

    key: str
    uuid: str
    before_x100: int  # its allowance before (% x 100)
    after_x100: int  # and now
    guarantee_pct: int
    burst_pct: int
    for_keys: tuple[str, ...]  # the busy neighbours on that GPU


class _LimitsCache:
    """Each container's sealed limits, decoded again only when the file changed (stat)."""

    def __init__(self) -> None:
        self._seen: dict[Path, tuple[tuple[int, int, int], ContainerLimits]] = {}

    def get(self, limits_dir: Path) -> ContainerLimits | None:
        path = limits_dir / "limits"
        try:
            st = os.stat(path)
        except OSError:
            self._seen.pop(limits_dir, None)
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._seen.get(limits_dir)
        if hit and hit[0] == stamp:
            return hit[1]
        try:
            limits = decode_limits(path.read_bytes())
        except (OSError, RegionFormatError):
            return None
        self._seen[limits_dir] = (stamp, limits)
        return limits

    def forget_others(self, keep: set[Path]) -> None:
        for d in [d for d in self._seen if d not in keep]:
            del self._seen[d]


class ComputeLender:
    """Applies `lend_compute` to the containers of each GPU: reads who is busy, rewrites the
    limits of elastic containers whose allowance changed. Not thread-safe: one caller (the node
    agent's lending loop, a benchmark)."""

    def __init__(self, idle_after_s: float = IDLE_AFTER_S) -> None:
        self.idle_after_ns = int(idle_after_s * 1e9)
        self._limits = _LimitsCache()
        self.rewrites = 0  # limits files rewritten (for tests and benchmarks)
        # times a busy elastic container's allowance was lowered (compute taken back for a
        # neighbour; an idle container falling back to its guarantee is not a reclaim), in all
        # and per (key, uuid) of the containers still watched; `taken`: the last tick's reclaims
        self.reclaims = 0
        self.reclaims_of: dict[tuple[str, str], int] = {}
        self.taken: list[ComputeTaken] = []
        self._busy: dict[str, set[str]] = {}  # uuid -> who was busy at the last tick
        # (key, uuid) -> (guarantee %, burst %, allowance % x 100) of every elastic container
        self.view: dict[tuple[str, str], tuple[int, int, int]] = {}

    def tick(
        self, gpus: Mapping[str, Sequence[LendingMember]], now_ns: int
    ) -> dict[tuple[str, str], int]:
        """One pass over `gpus` (uuid -> its containers); returns (key, uuid) -> allowance of
        every elastic container (% x 100)."""
        applied: dict[tuple[str, str], int] = {}
        view: dict[tuple[str, str], tuple[int, int, int]] = {}
        activity: dict[Path, dict[str, int]] = {}
        self.taken = []
        for uuid, members in gpus.items():
            claims, elastic = [], []
            for m in members:
                limits = self._limits.get(m.limits_dir)
                dev = limits.device(uuid) if limits else None
                if dev is None or not 0 < dev.sm_limit_pct < 100:
                    continue  # not limited on this GPU (or gone): not counted
                if m.region_path not in activity:
                    activity[m.region_path] = read_device_activity(m.region_path)
                last = activity[m.region_path].get(uuid, 0)
                busy = bool(last) and now_ns - last <= self.idle_after_ns
                claims.append(ComputeClaim(m.key, dev.sm_limit_pct, dev.sm_burst_limit_pct, busy))
                if dev.sm_elastic:
                    elastic.append((m, dev))
            if not elastic:
                continue
            allow = lend_compute(claims)
            was_busy = self._busy.get(uuid, set())
            busy_now = self._busy[uuid] = {c.key for c in claims if c.busy}
            for m, dev in elastic:
                want = allow[m.key]
                applied[(m.key, uuid)] = want
                view[(m.key, uuid)] = (dev.sm_limit_pct, dev.sm_burst_limit_pct, want)
                if dev.sm_allow_x100 == want:
                    continue
                try:
                    if not set_device_flags(m.limits_dir, uuid, sm_allow_x100=want):
                        continue
                except (FileNotFoundError, KeyError, RegionFormatError, OSError):
                    continue  # the container went away meanwhile
                self.rewrites += 1
                if want < dev.sm_allow_x100 and any(c.key == m.key and c.busy for c in claims):
                    self._taken(m.key, uuid, dev, want, busy_now - was_busy - {m.key}
                                or busy_now - {m.key})
        self._limits.forget_others({m.limits_dir for ms in gpus.values() for m in ms})
        for gone in [k for k in self.reclaims_of if k not in view]:
            del self.reclaims_of[gone]
        self.view = view
        for gone in [u for u in self._busy if u not in gpus]:
            del self._busy[gone]
        return applied

    def _taken(self, key: str, uuid: str, dev: DeviceLimit, want: int,
               for_keys: set[str]) -> None:  # fmt: skip
        """Compute taken back from `key` for `for_keys`: the neighbours that woke (or arrived)
        since the last tick, else every busy one."""
        self.reclaims += 1
        self.reclaims_of[(key, uuid)] = self.reclaims_of.get((key, uuid), 0) + 1
        self.taken.append(ComputeTaken(
            key, uuid, dev.sm_allow_x100, want, dev.sm_limit_pct, dev.sm_burst_limit_pct,
            tuple(sorted(for_keys))))
