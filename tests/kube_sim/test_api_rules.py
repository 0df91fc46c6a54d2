"""The pure rules behind kube-sim's API: NodeResourcesFit and its message, strategic merge patch
as kubectl apply sends it, selectors, and Table ages."""

from __future__ import annotations

from fractions import Fraction

import pytest
from tessera.kube_sim import strategic_merge
from tessera.kube_sim.fit import (
    NodeUsage,
    insufficient,
    node_refusal,
    pod_requests,
    unavailable_message,
)
from tessera.kube_sim.selectors import (
    SelectorError,
    fields_match,
    labels_match,
    parse_fields,
    parse_labels,
)
from tessera.kube_sim.tables import human_duration


def node(**allocatable: str) -> dict:
    return {"metadata": {"name": "n"}, "status": {"allocatable": allocatable}}


def pod(containers: list[dict], init: list[dict] | None = None) -> dict:
    return {"metadata": {"namespace": "d", "name": "p"},
            "spec": {"containers": containers, "initContainers": init or []}}


def limits(**values: str) -> dict:
    return {"name": "c", "resources": {"limits": {k.replace("_", "/"): v
                                                  for k, v in values.items()}}}


def test_effective_request_is_the_larger_of_app_sum_and_init_max() -> None:
    app = [{"name": "a", "resources": {"requests": {"cpu": "500m"}}},
           {"name": "b", "resources": {"limits": {"cpu": "1", "nvidia.com/gpu": "1"}}}]
    init = [{"name": "i", "resources": {"requests": {"cpu": "2"}}}]
    assert pod_requests(pod(app, init)) == {"cpu": Fraction(2), "nvidia.com/gpu": 1}
    assert pod_requests(pod(app)) == {"cpu": Fraction(3, 2), "nvidia.com/gpu": 1}


def test_a_node_offers_only_what_it_advertises() -> None:
    wanted = pod_requests(pod([limits(**{"nvidia.com/mig-1g.10gb": "1"})]))
    assert insufficient(wanted, node(cpu="64"), {}, frozenset()) == [
        "Insufficient nvidia.com/mig-1g.10gb"]
    assert insufficient(wanted, node(**{"nvidia.com/mig-1g.10gb": "1"}), {}, frozenset()) == []
    used = {"nvidia.com/mig-1g.10gb": Fraction(1)}
    assert insufficient(wanted, node(**{"nvidia.com/mig-1g.10gb": "1"}), used, frozenset()) == [
        "Insufficient nvidia.com/mig-1g.10gb"]
    # the extender's ignoredByScheduler resources are left to it
    gpu = pod_requests(pod([limits(**{"nvidia.com/gpu": "1"})]))
    assert insufficient(gpu, node(), {}, frozenset({"nvidia.com/gpu"})) == []
    cpu = pod_requests(pod([{"name": "c", "resources": {"requests": {"cpu": "65"}}}]))
    assert insufficient(cpu, node(cpu="64"), {}, frozenset()) == ["Insufficient cpu"]


def test_the_message_counts_each_reason_over_the_nodes_sorted() -> None:
    message = unavailable_message(3, {
        "a": ["Insufficient nvidia.com/gpu"],
        "b": ["Insufficient cpu", "Insufficient nvidia.com/gpu"],
        "c": ["node(s) didn't match Pod's node affinity/selector"],
    })
    assert message == ("0/3 nodes are available: 1 Insufficient cpu, 2 Insufficient "
                       "nvidia.com/gpu, 1 node(s) didn't match Pod's node affinity/selector.")


def test_node_usage_follows_binds_and_deletes() -> None:
    usage = NodeUsage()
    bound = pod([limits(**{"example.com/fpga": "2"})])
    bound["spec"]["nodeName"] = "n1"
    usage.observe(bound)
    usage.observe(bound)  # the same event twice counts once
    assert usage.used("n1") == {"example.com/fpga": 2}
    bound["status"] = {"phase": "Succeeded"}
    usage.observe(bound)
    assert usage.used("n1") == {"example.com/fpga": 0}


def test_strategic_merge_merges_containers_by_name() -> None:
    live = {"spec": {"containers": [
        {"name": "a", "image": "x:1", "env": [{"name": "K", "value": "1"}]},
        {"name": "b", "image": "y:1"},
    ], "tolerations": [{"key": "t"}]}}
    patch = {"spec": {
        "$setElementOrder/containers": [{"name": "b"}, {"name": "a"}],
        "containers": [{"name": "a", "image": "x:2", "env": [{"name": "J", "value": "2"}]},
                       {"name": "b", "$patch": "delete"}],
        "tolerations": [{"key": "u"}],
    }}
    merged = strategic_merge.apply(live, patch)
    assert merged["spec"]["containers"] == [
        {"name": "a", "image": "x:2", "env": [{"name": "K", "value": "1"},
                                               {"name": "J", "value": "2"}]}]
    assert merged["spec"]["tolerations"] == [{"key": "u"}]  # no merge key: replaced
    assert strategic_merge.apply({"metadata": {"labels": {"a": "1", "b": "2"}}},
                                 {"metadata": {"labels": {"a": None}}}) == {
        "metadata": {"labels": {"b": "2"}}}
    with pytest.raises(strategic_merge.PatchError):
        strategic_merge.apply(live, {"spec": {"containers": [{"image": "z"}]}})


def test_label_and_field_selectors() -> None:
    requirements = parse_labels("app in (web, api),tier!=db,!legacy,team")
    assert labels_match(requirements, {"app": "web", "team": "a"})
    assert not labels_match(requirements, {"app": "web", "team": "a", "legacy": "1"})
    assert not labels_match(requirements, {"app": "db", "team": "a"})
    with pytest.raises(SelectorError):
        parse_labels("a b c")
    unbound = parse_fields("spec.nodeName=,status.phase!=Failed")
    assert fields_match(unbound, {"spec": {}, "status": {"phase": "Pending"}})
    assert not fields_match(unbound, {"spec": {"nodeName": "n"}, "status": {"phase": "Pending"}})


@pytest.mark.parametrize(("seconds", "text"), [
    (5, "5s"), (119, "119s"), (125, "2m5s"), (600, "10m"), (3 * 3600 + 60, "3h1m"),
    (9 * 3600, "9h"), (50 * 3600, "2d2h"), (400 * 86400, "400d"), (-5, "<invalid>"),
])
def test_ages_read_as_kubectl_prints_them(seconds: int, text: str) -> None:
    assert human_duration(seconds) == text


def test_cordoned_and_tainted_nodes_refuse_pods_that_do_not_tolerate_them() -> None:
    plain = pod([limits()])
    cordoned = {"metadata": {"name": "n"}, "spec": {"unschedulable": True}}
    assert node_refusal(plain, cordoned) == "node(s) were unschedulable"
    tainted = {"metadata": {"name": "n"},
               "spec": {"taints": [{"key": "gpu", "value": "a100", "effect": "NoSchedule"}]}}
    assert node_refusal(plain, tainted) == "node(s) had untolerated taint {gpu: a100}"
    tolerant = pod([limits()])
    tolerant["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    assert node_refusal(tolerant, tainted) is None
    preferred = {"metadata": {"name": "n"},
                 "spec": {"taints": [{"key": "x", "effect": "PreferNoSchedule"}]}}
    assert node_refusal(plain, preferred) is None


def test_a_pod_whose_containers_are_not_a_list_is_refused_not_crashed() -> None:
    """A hostile shape gets kube-apiserver's 422 naming the field, never a 500."""
    import asyncio

    import httpx
    from tessera.kube_sim.apiserver import ApiServer
    from tessera.kube_sim.store import ObjectStore

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(ApiServer(ObjectStore()).app())
        async with httpx.AsyncClient(transport=transport, base_url="http://kube-sim") as client:
            return await client.post("/api/v1/namespaces/default/pods", json={
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "b"},
                "spec": {"containers": "not a list", "initContainers": 7}})

    reply = asyncio.run(post())
    assert reply.status_code == 422, reply.text
    assert "spec.containers: Required value" in reply.json()["message"]
