"""kubelet's device IDs against the node agent's replicas when one device spans several IDs.

A family's device may be more than one device to kubelet (`DeviceFamily.ids_per_device`: a
910C module is two NPUs, and a pod asks `huawei.com/Ascend910C: 2` for one module). The node
agent lists `split_count × k` IDs per device (`<uuid>-<j>`); IDs `r·k … r·k+k-1` are replica
`r`. At the boundary, kubelet's IDs collapse to replicas (each replica wholly or not at all)
so the handshake (handshake.py) counts grant units as the scheduler granted them, and the
replicas it prefers expand back to kubelet's IDs. k = 1 (NVIDIA and most families) is the
identity: nothing changes on those paths. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from tessera.node_agent.handshake import HandshakeError, replica_id


def _split(device_id: str) -> tuple[str, int]:
    base, sep, suffix = device_id.rpartition("-")
    if not sep or not suffix.isdigit():
        raise HandshakeError(f"unknown device ID {device_id!r}: not one this node lists",
                             invalid=True)
    return base, int(suffix)


class DeviceUnits:
    def __init__(self, per_device: int = 1) -> None:
        if per_device < 1:
            raise ValueError(f"ids_per_device must be at least 1, not {per_device}")
        self.k = per_device

    def listed(self, uuid: str, split_count: int) -> list[str]:
        """kubelet's IDs of one device (ListAndWatch)."""
        return [replica_id(uuid, j) for j in range(split_count * self.k)]

    def size(self, ids_asked: int) -> int:
        """Grant units in a request of `ids_asked` IDs (GetPreferredAllocation's size)."""
        if ids_asked % self.k:
            raise HandshakeError(
                f"kubelet asks for {ids_asked} devices, but a device here is {self.k} of them: "
                f"ask a multiple of {self.k}", mismatch=True)
        return ids_asked // self.k

    def collapse(self, ids: Iterable[str]) -> list[str]:
        """kubelet's IDs -> replicas, in order; each replica must come whole (all its k IDs)."""
        ids = list(ids)
        if self.k == 1:
            return ids
        counts: dict[str, int] = {}
        for device_id in ids:
            base, j = _split(device_id)
            rid = replica_id(base, j // self.k)
            counts[rid] = counts.get(rid, 0) + 1
        partial = [r for r, n in counts.items() if n != self.k]
        if partial:
            raise HandshakeError(
                f"device IDs {ids} split a device: each of {', '.join(partial)} is {self.k} "
                "IDs, all of which go to one container", invalid=True)
        return list(counts)

    def whole(self, ids: Iterable[str]) -> list[str]:
        """The replicas all of whose IDs are among `ids` (what kubelet still offers)."""
        ids = list(ids)
        if self.k == 1:
            return ids
        counts: dict[str, int] = {}
        for device_id in ids:
            try:
                base, j = _split(device_id)
            except HandshakeError:
                continue
            rid = replica_id(base, j // self.k)
            counts[rid] = counts.get(rid, 0) + 1
        return [r for r, n in counts.items() if n == self.k]

    def touched(self, ids: Iterable[str]) -> list[str]:
        """The replicas any of `ids` belongs to (kubelet's must-include IDs)."""
        ids = list(ids)
        if self.k == 1:
            return ids
        out: dict[str, None] = {}
        for device_id in ids:
            base, j = _split(device_id)
            out[replica_id(base, j // self.k)] = None
        return list(out)

    def expand(self, replicas: Iterable[str]) -> list[str]:
        """Replicas -> kubelet's IDs (GetPreferredAllocation's answer)."""
        replicas = list(replicas)
        if self.k == 1:
            return replicas
        out = []
        for rid in replicas:
            base, r = _split(rid)
            out.extend(replica_id(base, r * self.k + j) for j in range(self.k))
        return out
