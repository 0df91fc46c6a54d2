"""The node's advertised devices, shared by registration, ListAndWatch and the handshake."""

from __future__ import annotations

import asyncio

from tessera.models import DeviceInfo


class DeviceState:
    """The current DeviceInfo list with a version that moves on every change."""

    def __init__(self, devices: list[DeviceInfo] | None = None) -> None:
        self._devices = list(devices or [])
        self._version = 0
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int:
        return self._version

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def by_uuid(self) -> dict[str, DeviceInfo]:
        return {d.uuid: d for d in self._devices}

    async def update(self, devices: list[DeviceInfo]) -> bool:
        """Replace the list; wakes ListAndWatch streams when something differs."""
        if devices == self._devices:
            return False
        async with self._changed:
            self._devices = list(devices)
            self._version += 1
            self._changed.notify_all()
        return True

    async def wait_change(self, seen_version: int) -> tuple[list[DeviceInfo], int]:
        """The devices as soon as the version differs from `seen_version`."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != seen_version)
            return list(self._devices), self._version
