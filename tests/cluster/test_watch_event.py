"""The cluster port's WatchEvent keeps the pydantic model's contract (it is a plain class now)."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from tessera.cluster.port import WatchEvent


def test_holds_a_shallow_copy_and_compares_by_value() -> None:
    pod = {"metadata": {"uid": "u1"}, "spec": {}}
    event = WatchEvent(type="ADDED", object=pod)
    assert event.type == "ADDED" and event.object == pod
    assert event.object is not pod and event.object["metadata"] is pod["metadata"]
    pod["status"] = {}  # the caller's dict changing later does not change the event
    assert "status" not in event.object
    assert event == WatchEvent(type="ADDED", object={"metadata": {"uid": "u1"}, "spec": {}})
    assert event != WatchEvent(type="MODIFIED", object=event.object)
    assert event != WatchEvent(type="ADDED", object={})
    assert repr(event) == "WatchEvent(type='ADDED', object={'metadata': {'uid': 'u1'}, 'spec': {}})"
    with pytest.raises(TypeError):
        hash(event)


def test_takes_any_mapping_as_a_dict() -> None:
    event = WatchEvent(type="DELETED", object=OrderedDict(metadata={"uid": "u2"}))
    assert type(event.object) is dict and event.object == {"metadata": {"uid": "u2"}}


@pytest.mark.parametrize("kwargs", [
    {"type": "BOOKMARK", "object": {}},
    {"type": "added", "object": {}},
    {"type": "ADDED", "object": ["not", "a", "mapping"]},
    {"type": "ADDED", "object": None},
    {"type": "ADDED", "object": {1: "a key that is not a string"}},
])  # fmt: skip
def test_refuses_what_the_model_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WatchEvent(**kwargs)
    with pytest.raises(TypeError):
        WatchEvent("ADDED", {})  # type: ignore[misc]  # keywords only, as the model took
