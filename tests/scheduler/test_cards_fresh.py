"""A node's cards built from its devices on its first fit (`cards.cards_with_usage`: a card
made field by field, not through `Card.__init__`) must be exactly what `Card.from_device` makes
and the usage maps charge: every field of every card, for devices as the index holds them
(pydantic models, and the checked wire Structs the service keeps until a model is needed),
any mode (a kind's, an unknown one, dynamic MIG), cordoned cards, duplicated UUIDs, several
usage maps (HAMi's pods beside the ledger's)."""

from __future__ import annotations

import dataclasses
import random

from tessera.scheduler.cards import Card, _charged, cards_with_usage
from tessera.scheduler.registration_codec import RegistrationCodec

from tessera.codec import encode
from tessera.models import MigCapability, NodeRegistration

from .factories import GIB, device

MODES = ["hami-core"] * 4 + ["mps", "mig", "smlu", "no-such-mode"]


def every_field(cards: list[Card]) -> list[tuple[object, ...]]:
    """Each card's fields (all of them: a slot never set raises here) and its type."""
    names = [f.name for f in dataclasses.fields(Card)]
    return [(type(c), *(getattr(c, n) for n in names), getattr(c, "partitions", "unset"))
            for c in cards]  # fmt: skip


def reference(
    registration: NodeRegistration, usages: list[dict[str, list[int]]], cordoned: frozenset[str]
) -> list[Card]:
    """The build as it was: `Card.from_device` per device, then charged."""
    return _charged([Card.from_device(d, d.uuid in cordoned) for d in registration.devices],
                    usages)  # fmt: skip


def registration(name: str, rng: random.Random) -> NodeRegistration:
    devices = []
    for i in range(rng.choice([0, 1, 4, 8])):
        uuid = f"GPU-{name}-{i}" if rng.random() > 0.1 else f"GPU-{name}-0"  # (a duplicate)
        d = device(uuid, i, memory_mib=rng.choice([16, 80]) * GIB, split=rng.choice([1, 10]),
                   cores=rng.choice([0, 100, 200]), numa=rng.choice([0, 1]),
                   healthy=rng.random() > 0.1, mode=rng.choice(MODES),
                   links={f"GPU-{name}-{i + 1}": 2} if rng.random() < 0.5 else None)
        if rng.random() < 0.1:
            d = d.model_copy(update={"mig": MigCapability(model="A100-SXM4-80GB"), "mode": "mig"})
        devices.append(d)
    return NodeRegistration(node=name, devices=devices, heartbeat_at=100.0)


def usage_maps(reg: NodeRegistration, rng: random.Random) -> list[dict[str, list[int]]]:
    maps = []
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        held = {d.uuid: [rng.randint(0, 8) * GIB, rng.choice([0, 10, 30]), rng.randint(0, 3)]
                for d in reg.devices if rng.random() < 0.7}  # fmt: skip
        held["GPU-gone"] = [GIB, 10, 1]  # (a GPU no longer registered: nothing to charge)
        maps.append(held)
    return maps


def test_fresh_cards_are_the_ones_from_device_makes() -> None:
    rng = random.Random(35)
    codec = RegistrationCodec()
    wire = 0
    for n in range(400):
        reg = registration(f"n{n}", rng)
        usages = usage_maps(reg, rng)
        uuids = [d.uuid for d in reg.devices]
        cordoned = frozenset(u for u in uuids if rng.random() < 0.2)
        expected = every_field(reference(reg, usages, cordoned))
        assert every_field(cards_with_usage(reg, usages, cordoned)) == expected
        # the devices as the service holds them once read off the bus (checked, not built)
        read = codec.read(encode(reg))
        wire += type(read) is not NodeRegistration
        assert every_field(cards_with_usage(read, usages, cordoned)) == expected  # type: ignore[arg-type]
    assert wire > 100, wire


def test_a_fresh_card_is_its_own() -> None:
    """Two builds share no card and no mutable field but the registration's links map (as
    `Card.from_device`): a fit that charges its copy of a card changes nothing else."""
    reg = registration("n1", random.Random(3))
    first, second = cards_with_usage(reg, []), cards_with_usage(reg, [])
    for a, b in zip(first, second, strict=True):
        assert a is not b and a.mig_instances is not b.mig_instances
        a.used_mem += GIB
        assert b.used_mem == 0
