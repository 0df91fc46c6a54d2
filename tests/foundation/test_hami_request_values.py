"""A read request is a value: ContainerRequest and PodRequest are built with one update of the
instance's dict (not a frozen setattr per field), and must stay what the generated frozen
dataclasses were: every field set (defaults included), immutable, equal and hashed by value,
`dataclasses.replace` and `repr` as before (the refusal memo keys on the repr)."""

from __future__ import annotations

import dataclasses

import pytest

from tessera import elastic
from tessera.hami import ContainerRequest, PodRequest


def test_a_container_request_is_a_frozen_value_with_its_defaults() -> None:
    one = ContainerRequest(2, 1024, None, 30)
    assert (one.count, one.memory_mib, one.memory_percentage, one.cores, one.priority,
            one.burst, one.family) == (2, 1024, None, 30, None, None, "nvidia")  # fmt: skip
    twin = ContainerRequest(count=2, memory_mib=1024, memory_percentage=None, cores=30)
    assert one == twin and hash(one) == hash(twin) and len({one, twin}) == 1
    assert one != ContainerRequest(2, 1024, None, 30, family="ascend")
    assert repr(one) == ("ContainerRequest(count=2, memory_mib=1024, memory_percentage=None, "
                         "cores=30, priority=None, burst=None, family='nvidia')")  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.cores = 50  # type: ignore[misc]
    burst = elastic.BurstLimit(memory_mib=4096, memory_percentage=None, cores=60)
    more = dataclasses.replace(one, count=1, burst=burst)
    assert (more.count, more.burst, more.cores, one.count) == (1, burst, 30, 2)
    assert [f.name for f in dataclasses.fields(one)] == [
        "count", "memory_mib", "memory_percentage", "cores", "priority", "burst", "family"]
    with pytest.raises(TypeError):
        ContainerRequest(1, 2, None)  # type: ignore[call-arg]


def test_a_pod_request_is_a_frozen_value_with_fresh_lists() -> None:
    empty, other = PodRequest(), PodRequest()
    assert empty.init == [] and empty.containers == [] and empty.sidecars == frozenset()
    assert empty.init is not other.init and empty.containers is not other.containers
    one = ContainerRequest(1, 0, 50, 0)
    pod = PodRequest(init=[None], containers=[one], sidecars=frozenset({0}))
    assert pod == PodRequest([None], [one], frozenset({0})) and pod.all == [None, one]
    assert pod.wants_gpu and not PodRequest(containers=[None]).wants_gpu
    with pytest.raises(dataclasses.FrozenInstanceError):
        pod.sidecars = frozenset()  # type: ignore[misc]
    assert dataclasses.replace(pod, containers=[]).init == [None]
    assert repr(pod).startswith("PodRequest(init=[None], containers=[ContainerRequest(")
