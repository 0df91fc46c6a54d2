"""Dynamic MIG fitting on one card (tessera/device_kinds/nvidia/mig_fit.py), table-driven from
NVIDIA's profile tables (tessera/mig.py): the profile chosen, where it goes next to existing
instances, what it charges, and the refusal sentence when it cannot go anywhere."""

from __future__ import annotations

import pytest

from tessera import mig
from tessera.device_kinds.nvidia import mig_fit
from tessera.device_kinds.nvidia.mig_fit import MigFit, MigRefusal
from tessera.mig import Instance

A100 = "NVIDIA-A100-SXM4-80GB"
A30 = "NVIDIA-A30"
H200 = "NVIDIA-H200"


@pytest.mark.parametrize(
    ("card", "existing", "memory", "cores", "profile", "start", "charged"),
    [
        # the smallest covering profile on an empty card, placed where it fragments least
        (A100, [], 8000, 0, "1g.10gb", 6, (10240, 14)),
        (A100, [], 10240, 0, "1g.10gb", 6, (10240, 14)),
        (A100, [], 10241, 0, "1g.20gb", 6, (20480, 14)),
        (A100, [], 10000, 20, "2g.20gb", 4, (20480, 28)),  # compute decides
        (A100, [], 30000, 0, "3g.40gb", 4, (40960, 42)),
        (A100, [], 40000, 50, "4g.40gb", 0, (40960, 57)),
        (A100, [], 50000, 0, "7g.80gb", 0, (81920, 100)),
        (A30, [], 6000, 0, "1g.6gb", 3, (6144, 25)),
        (A30, [], 7000, 0, "2g.12gb", 2, (12288, 50)),
        (H200, [], 20000, 0, "1g.35gb", 6, (36096, 14)),
        # next to existing instances: only free slices, never overlapping
        (A100, [Instance("3g.40gb", 4)], 30000, 0, "3g.40gb", 0, (40960, 42)),
        (A100, [Instance("4g.40gb", 0)], 10000, 0, "1g.10gb", 6, (10240, 14)),
        (A100, [Instance("1g.10gb", 6), Instance("1g.10gb", 5)], 10000, 0, "1g.10gb", 4,
         (10240, 14)),
        # the smallest covering profile has no room: the next one that does is taken
        (A100, [Instance("1g.10gb", s) for s in (0, 1, 2, 3, 4, 5)], 9000, 0, "1g.10gb", 6,
         (10240, 14)),
        (A30, [Instance("1g.6gb", 0), Instance("1g.6gb", 1)], 5000, 0, "1g.6gb", 3, (6144, 25)),
        (A30, [Instance("1g.6gb", 0), Instance("1g.6gb", 1), Instance("1g.6gb", 3)], 5000, 0,
         "1g.6gb", 2, (6144, 25)),
    ],
)
def test_profile_and_placement(card, existing, memory, cores, profile, start, charged) -> None:
    result = mig_fit.fit(card, existing, memory, cores)
    assert result == MigFit(profile, start, *charged)
    # what was chosen is a geometry the hardware can hold
    model = mig.model_for(card)
    mig.occupied(model, [*existing, Instance(result.profile, result.start)])


@pytest.mark.parametrize(
    ("card", "existing", "memory", "cores", "libvgpu", "says"),
    [
        ("NVIDIA-A10", [], 1000, 0, 0, "has no MIG profiles"),
        (A100, [], 1000, 0, 2, "holds 2 libvgpu slice(s)"),
        (A100, [], 90000, 0, 0, "no MIG profile of A100-SXM4-80GB covers 90000 MiB"),
        (A30, [], 30000, 50, 0, "no MIG profile of A30 covers 30000 MiB and 50 %"),
        (A100, [Instance("4g.40gb", 0), Instance("3g.40gb", 4)], 1000, 0, 0,
         "1g.10gb: no free placement"),
        (A100, [Instance("3g.40gb", 0)], 45000, 0, 0, "7g.80gb: no free placement"),
        (A100, [Instance("3g.40gb", 0)], 45000, 0, 0, "instances on the card: 3g.40gb@0"),
        (A100, [Instance("3g.40gb", 2)], 1000, 0, 0, "not a valid geometry"),
    ],
)
def test_refusals_name_the_reason(card, existing, memory, cores, libvgpu, says) -> None:
    result = mig_fit.fit(card, existing, memory, cores, libvgpu_slices=libvgpu)
    assert isinstance(result, MigRefusal)
    assert result.reason == "CardMigTopologyInfeasible"
    assert says in result.detail, result.detail


def test_a_mix_of_requests_packs_one_card_into_an_allowed_geometry() -> None:
    """Requests arrive one by one; each goes where the next still fits, until the card is
    full, and the result is one of NVIDIA's documented layouts."""
    placed: list[Instance] = []
    for memory in (30000, 15000, 8000, 8000):  # 3g + 2g... as the smallest covering profiles
        result = mig_fit.fit(A100, placed, memory, 0)
        assert isinstance(result, MigFit), result
        placed.append(Instance(result.profile, result.start))
    assert sorted(i.profile for i in placed) == ["1g.10gb", "1g.10gb", "1g.20gb", "3g.40gb"]
    full = mig_fit.fit(A100, placed, 8000, 0)
    assert isinstance(full, MigRefusal)
    mig.occupied(mig.MODELS["A100-SXM4-80GB"], placed)


def test_operator_geometries_limit_the_choice() -> None:
    only_sevens = [{"1g.10gb": 7}]
    assert mig_fit.fit(A100, [], 8000, 0, geometries=only_sevens).profile == "1g.10gb"
    refused = mig_fit.fit(A100, [], 15000, 0, geometries=only_sevens)
    assert isinstance(refused, MigRefusal) and "outside the allowed geometries" in refused.detail
