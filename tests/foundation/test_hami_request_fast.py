"""A container's GPU request is read without a Decimal for the usual values (an int, a string
of ASCII digits) and its limits and requests once: the same request, and for anything else the
same refusal, as reading each resource on its own through `parse_quantity`."""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

import pytest

from tessera import hami
from tessera.hami import (
    MAX_GPU_COUNT,
    MAX_MEMORY_MIB,
    ContainerRequest,
    RequestError,
    _as_int,
    _resources,
    parse_quantity,
)
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()
KEYS = (SETTINGS.resource_name, SETTINGS.resource_mem, SETTINGS.resource_mem_percentage,
        SETTINGS.resource_cores, SETTINGS.resource_priority)  # fmt: skip


def reference(container: dict[str, Any], settings: TesseraSettings) -> ContainerRequest | None:
    """parse_container_request as it was: each resource looked up and parsed on its own."""
    name = container.get("name", "?")
    raw_count, raw_mem, raw_pct, raw_cores, raw_priority = (
        _resources(container, key) for key in KEYS
    )
    where = f"container {name}: "
    count = 0
    if raw_count is not None:
        count = _as_int(raw_count, where + settings.resource_name, low=0, high=MAX_GPU_COUNT)
    memory = 0
    if raw_mem is not None:
        # memory reads every form the API server writes (`3k`), refusing units and fractions
        memory = hami.memory_mib(raw_mem, settings.resource_mem, where)
        if not 0 <= memory <= MAX_MEMORY_MIB:
            _as_int(raw_mem, where + settings.resource_mem, low=0, high=MAX_MEMORY_MIB)
        memory *= settings.memory_factor
        if memory > MAX_MEMORY_MIB:
            raise RequestError(f"{where}{settings.resource_mem} overflows after memory factor")
    percentage = None
    if raw_pct is not None:
        pct = parse_quantity(raw_pct, where + settings.resource_mem_percentage)
        if pct > 0:
            percentage = int(min(pct, Decimal(100)))
    cores = settings.default_cores
    if raw_cores is not None:
        cores = min(100, _as_int(raw_cores, where + settings.resource_cores, low=0, high=10**9))
    priority = None
    if raw_priority is not None:
        priority = _as_int(raw_priority, where + settings.resource_priority, low=0, high=1)
    if count == 0:
        if raw_mem is None and raw_pct is None and raw_cores is None:
            return None
        count = settings.default_gpu_num
    if memory == 0 and percentage is None:
        if settings.default_mem:
            memory = settings.default_mem
        else:
            percentage = 100
    if memory and percentage is not None:
        percentage = None
    return ContainerRequest(count, memory, percentage, cores, priority)


VALUES: list[Any] = [
    0, 1, 2, 8, 100, 101, 1024, 16384, 10**9, 10**9 + 1, MAX_MEMORY_MIB, MAX_MEMORY_MIB + 1, -1,
    "0", "1", "007", "16384", "100", "101", "1" * 64, "1" * 65, "", " 5", "5 ", "+5", "-3",
    "1e3", "1.5", "2Gi", "500m", "3k", "12M", "3000000m", "١", "²", "abc", 1.0, 2.5, True,
    False, None, [1], {"a": 1},
    Decimal(3),
]  # fmt: skip


def outcome(parse: Any, container: dict[str, Any]) -> object:
    try:
        return parse(container, SETTINGS)
    except RequestError as exc:
        return ("refused", str(exc))


def test_every_value_reads_as_before() -> None:
    rng = random.Random(3)
    for _ in range(4000):
        sections: dict[str, Any] = {}
        for section in ("limits", "requests"):
            roll = rng.random()
            if roll < 0.05:
                sections[section] = rng.choice(["x", [1], None, 0])
            elif roll < 0.2:
                continue
            else:
                sections[section] = {k: rng.choice(VALUES) for k in KEYS if rng.random() < 0.5}
        container: dict[str, Any] = {"name": "c", "resources": sections}
        if rng.random() < 0.03:
            container["resources"] = rng.choice(["x", None, [], {}])
        assert outcome(hami.parse_container_request, container) == outcome(reference, container)


def test_plain_quantities_need_no_decimal(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(value: object, resource: str = "") -> Decimal:
        raise AssertionError(f"parsed {value!r} through a Decimal")

    monkeypatch.setattr(hami, "parse_quantity", refuse)
    container = {"name": "c", "resources": {
        "limits": {SETTINGS.resource_name: "2", SETTINGS.resource_mem: 8192,
                   SETTINGS.resource_cores: "30", SETTINGS.resource_mem_percentage: 20},
    }}  # fmt: skip
    assert hami.parse_container_request(container, SETTINGS) == ContainerRequest(
        2, 8192 * SETTINGS.memory_factor, None, 30, None
    )


def test_a_plain_percentage_needs_no_decimal(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(value: object, resource: str = "") -> Decimal:
        raise AssertionError(f"parsed {value!r} through a Decimal")

    monkeypatch.setattr(hami, "parse_quantity", refuse)
    for written, read in (("40", 40), ("0040", 40), ("250", 100), ("1" * 64, 100), (7, 7)):
        container = {"name": "c", "resources": {
            "limits": {SETTINGS.resource_name: "1", SETTINGS.resource_mem_percentage: written},
        }}  # fmt: skip
        got = hami.parse_container_request(container, SETTINGS)
        assert got == ContainerRequest(1, 0, read, SETTINGS.default_cores, None)
