"""tessera.io/scrub-on-free: the scheduler reads it and records it in the pod's allocation, for
the node agent to seal (issue 19, item 7). A value other than true/false is a request error."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.scheduler.rules import parse_pod_options

from tessera import hami
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.hami import RequestError
from tessera.settings import TesseraSettings

from .conftest import MakeService, http_client, unique
from .factories import container, node, pod
from .test_extender import bind_call, filter_call, ledger, setup_node


@pytest.mark.parametrize(
    ("value", "expected"), [(None, False), ("true", True), ("TRUE", True), ("false", False)]
)
def test_annotation_is_read(value: str | None, expected: bool) -> None:
    annotations = {} if value is None else {hami.ANN_SCRUB_ON_FREE: value}
    options = parse_pod_options(pod(container(), annotations=annotations), TesseraSettings())
    assert options.scrub_on_free is expected


@pytest.mark.parametrize("value", ["yes", "1", ""])
def test_a_bad_value_is_a_request_error(value: str) -> None:
    with pytest.raises(RequestError, match="scrub-on-free"):
        parse_pod_options(
            pod(container(), annotations={hami.ANN_SCRUB_ON_FREE: value}), TesseraSettings()
        )


async def test_the_allocation_carries_it(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster
) -> None:
    service = await make_service()
    name = await setup_node(buckets, service, node(unique("n"), gpus=1))
    asked: dict[str, Any] = cluster.add_pod(
        pod(container(mem=1000), annotations={hami.ANN_SCRUB_ON_FREE: "true"})
    )
    async with http_client(service) as client:
        assert (await filter_call(client, asked, [name]))["nodenames"] == [name]
        assert await bind_call(client, asked, name) == ""
    state = await ledger(buckets, name)
    assert state.allocations[asked["metadata"]["uid"]].scrub_on_free is True
