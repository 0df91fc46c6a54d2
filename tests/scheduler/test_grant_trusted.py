"""A placed pod's grants on NVIDIA's libvgpu slices are built without pydantic's validation
(`placement._amounts_grant`: the request's own amounts on the card, values the scheduler read
and checked itself). They must be the very models validation builds: equal, the same fields
set, the same wire bytes alone, in an allocation and in a ledger entry (`tessera.codec` and the
scheduler's `LedgerCodec`), read back equal; and a value validation refuses (a negative amount
that never came through the pod parser) must still be refused."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError
from tessera.scheduler import placement
from tessera.scheduler.cards import Card, cards_with_usage
from tessera.scheduler.ledger_codec import LedgerCodec
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.rules import FitContext, PodOptions, QuotaBudget

from tessera import elastic
from tessera.codec import decode, encode
from tessera.hami import ContainerRequest, PodRequest, RequestError, parse_pod_request
from tessera.models import Allocation, DeviceGrant, NodeLedger
from tessera.settings import TesseraSettings

from .factories import GIB, container, node, pod


def validated(grant: DeviceGrant) -> DeviceGrant:
    """The grant as NVIDIA's kind builds it, through validation."""
    return DeviceGrant(uuid=grant.uuid, type=grant.type, memory_mib=grant.memory_mib,
                       cores=grant.cores, **({} if not grant.memory_limit_mib else {
                           "memory_limit_mib": grant.memory_limit_mib,
                           "cores_limit": grant.cores_limit}))  # fmt: skip


def test_the_grants_are_the_models_validation_builds_byte_for_byte() -> None:
    rng = random.Random(35)
    registration = node("n1", gpus=8)
    cards = cards_with_usage(registration, [])
    allocations = {}
    for i in range(300):
        containers = [ContainerRequest(
            count=rng.choice([1, 1, 2, 4, 8]), memory_mib=rng.choice([0, 1, 3 * GIB, 80 * GIB]),
            memory_percentage=rng.choice([None, None, 0, 7, 100]),
            cores=rng.choice([0, 1, 30, 100]),
        ) for _ in range(rng.choice([1, 1, 2]))]  # fmt: skip
        request = PodRequest(containers=containers)
        options = PodOptions(gpu_policies=(rng.choice(["spread", "binpack"]),))
        fit = fit_pod(cards, request, FitContext(options, QuotaBudget()))
        if not fit.ok:
            continue
        for grants in fit.containers:
            for grant in grants:
                twin = validated(grant)
                assert grant == twin and grant.__dict__ == twin.__dict__
                assert list(grant.__dict__) == list(twin.__dict__)  # (the dump's order)
                assert grant.model_fields_set == twin.model_fields_set
                assert grant.__pydantic_extra__ is None and grant.__pydantic_private__ is None
                assert encode(grant) == encode(twin)
                assert grant.model_dump_json() == twin.model_dump_json()
                assert decode(encode(grant), DeviceGrant) == grant
        uid = f"uid-{i}"
        allocation = Allocation(pod_uid=uid, namespace="ns", name=uid, node="n1",
                                containers=fit.containers)  # fmt: skip
        twin_allocation = allocation.model_copy(update={"containers": [
            [validated(g) for g in grants] for grants in fit.containers]})
        assert encode(allocation) == encode(twin_allocation)
        allocations[uid] = allocation
    assert len(allocations) > 100, len(allocations)
    ledger = NodeLedger(node="n1", allocations=allocations)
    assert LedgerCodec().encode(ledger) == encode(ledger)
    assert decode(encode(ledger), NodeLedger) == ledger


def test_an_elastic_grant_carries_its_limits_as_validation_would() -> None:
    burst = elastic.BurstLimit(memory_mib=20 * GIB, memory_percentage=None, cores=60)
    request = PodRequest(containers=[ContainerRequest(
        count=1, memory_mib=4 * GIB, memory_percentage=None, cores=20, burst=burst)])
    cards = cards_with_usage(node("n1", gpus=2), [])
    fit = fit_pod(cards, request, FitContext(PodOptions(), QuotaBudget()))
    assert fit.ok
    (grant,) = fit.containers[0]
    assert (grant.memory_mib, grant.memory_limit_mib, grant.cores, grant.cores_limit) == (
        4 * GIB, 20 * GIB, 20, 60)
    assert encode(grant) == encode(validated(grant))


def test_a_placed_pod_builds_its_grants_without_validating_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the shortcut is for: no grant of a plain pod goes through pydantic's validator."""
    validations = []
    real = DeviceGrant.__init__

    def counted(self: DeviceGrant, **values: object) -> None:
        validations.append(values)
        real(self, **values)

    monkeypatch.setattr(DeviceGrant, "__init__", counted)
    request = parse_pod_request(pod(container(gpus=2, mem=GIB, cores=10),
                                    container("side", gpus=1, pct=10)), TesseraSettings())
    fit = fit_pod(cards_with_usage(node("n1", gpus=4), []), request,
                  FitContext(PodOptions(), QuotaBudget()))  # fmt: skip
    assert fit.ok and sum(map(len, fit.containers)) == 3
    assert validations == []


def test_a_value_validation_refuses_is_still_refused() -> None:
    """The pod parser refuses a negative amount; one that reaches the fit anyway (built by
    hand, never from a pod) is built validated and refused there, as before."""
    with pytest.raises(RequestError):
        parse_pod_request(pod(container(gpus=1, mem=-5)), TesseraSettings())
    cards = cards_with_usage(node("n1", gpus=1), [])
    for bad in (ContainerRequest(count=1, memory_mib=-5, memory_percentage=None, cores=0),
                ContainerRequest(count=1, memory_mib=GIB, memory_percentage=None, cores=-1)):
        card = cards[0]
        with pytest.raises(ValidationError):
            placement._amounts_grant(card, bad)
    odd = Card(uuid=7, index=0, type="NVIDIA-H100", mode="hami-core", numa=0,  # type: ignore[arg-type]
               healthy=True, cordoned=False, memory_mib=80 * GIB, cores=100, split_count=10)
    with pytest.raises(ValidationError):
        placement._amounts_grant(odd, ContainerRequest(1, GIB, None, 0))


@pytest.mark.parametrize("change", ["validator", "field", "constraint", "mutable default"])
def test_the_shortcut_is_off_for_a_grant_model_it_cannot_build_exactly(
    change: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DeviceGrant that gained a validator, a field without a plain default, a constraint
    on an amount or a mutable default is built validated (no template)."""
    from pydantic import Field, field_validator

    if change == "validator":
        class Changed(DeviceGrant):
            @field_validator("uuid")
            @classmethod
            def upper(cls, value: str) -> str:
                return value.upper()
    elif change == "field":
        class Changed(DeviceGrant):  # type: ignore[no-redef]
            owner: str
    elif change == "constraint":
        class Changed(DeviceGrant):  # type: ignore[no-redef]
            cores: int = Field(ge=0, le=100)
    else:
        class Changed(DeviceGrant):  # type: ignore[no-redef]
            notes: list[str] = []  # noqa: RUF012

    assert placement._grant_template() is not None
    monkeypatch.setattr(placement, "DeviceGrant", Changed)
    assert placement._grant_template() is None
