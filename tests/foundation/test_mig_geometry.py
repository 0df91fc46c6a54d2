"""MIG geometry rules, table-driven from NVIDIA's MIG user guide ("Supported MIG Profiles")."""

from __future__ import annotations

import math

import pytest

from tessera import mig
from tessera.mig import Instance, MigError

A100_40 = mig.MODELS["A100-SXM4-40GB"]
A100_80 = mig.MODELS["A100-SXM4-80GB"]
H200 = mig.MODELS["H200"]
A30 = mig.MODELS["A30"]


@pytest.mark.parametrize("model", list(mig.MODELS.values()), ids=lambda m: m.name)
def test_profile_names_agree_with_their_slices(model: mig.MigModel) -> None:
    """Each profile's name says its compute slices and its memory in GB, as the guide prints it."""
    for profile in model.profiles:
        g, gb = mig.parse_profile_name(profile.name)
        assert g == profile.compute_slices
        assert math.floor(model.profile_memory_mib(profile) / 1024 + 0.5) == gb, profile.name
        assert all(s >= 0 and s + profile.memory_slices <= model.memory_slices
                   for s in profile.starts)  # fmt: skip


@pytest.mark.parametrize(
    ("model", "geometry"),
    [
        (A100_40, {"1g.5gb": 7}),
        (A100_40, {"2g.10gb": 3, "1g.5gb": 1}),
        (A100_40, {"3g.20gb": 2}),
        (A100_40, {"4g.20gb": 1, "3g.20gb": 1}),
        (A100_40, {"4g.20gb": 1, "2g.10gb": 1, "1g.5gb": 1}),
        (A100_40, {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}),
        (A100_40, {"4g.20gb": 1, "1g.5gb": 3}),
        (A100_40, {"1g.10gb": 4}),
        (A100_40, {"2g.10gb": 3, "1g.10gb": 1}),
        (A100_40, {"7g.40gb": 1}),
        (A100_80, {"3g.40gb": 1, "1g.20gb": 2}),
        (H200, {"1g.18gb": 7}),
        (H200, {"4g.71gb": 1, "3g.71gb": 1}),
        (A30, {"1g.6gb": 4}),
        (A30, {"2g.12gb": 2}),
        (A30, {"2g.12gb": 1, "1g.6gb": 2}),
        (A30, {"4g.24gb": 1}),
    ],
)
def test_documented_geometries_fit(model: mig.MigModel, geometry: dict[str, int]) -> None:
    mig.validate_geometries(model, [geometry])


@pytest.mark.parametrize(
    ("model", "geometry", "why"),
    [
        (A100_40, {"1g.5gb": 8}, "does not fit"),
        (A100_40, {"4g.20gb": 2}, "does not fit"),
        (A100_40, {"3g.20gb": 2, "1g.5gb": 1}, "does not fit"),
        (A100_40, {"7g.40gb": 1, "1g.5gb": 1}, "does not fit"),
        (A100_40, {"1g.10gb": 5}, "does not fit"),
        (A100_40, {"2g.10gb": 4}, "does not fit"),
        (A100_40, {"1g.20gb": 1}, "no MIG profile"),
        (A30, {"4g.24gb": 1, "1g.6gb": 1}, "does not fit"),
        (A30, {"1g.6gb": 5}, "does not fit"),
        (A30, {"1g.6gb": 0}, "must be ≥ 1"),
    ],
)
def test_impossible_geometries_are_refused_with_the_reason(
    model: mig.MigModel, geometry: dict[str, int], why: str
) -> None:
    with pytest.raises(MigError, match=why):
        mig.validate_geometries(model, [geometry])


def test_overlapping_or_misplaced_instances_are_refused() -> None:
    with pytest.raises(MigError, match="overlaps"):
        mig.occupied(A100_40, [Instance("3g.20gb", 4), Instance("1g.5gb", 6)])
    with pytest.raises(MigError, match="cannot start at memory slice 2"):
        mig.occupied(A100_40, [Instance("3g.20gb", 2)])
    with pytest.raises(MigError, match="no MIG profile"):
        mig.occupied(A100_40, [Instance("1g.6gb", 0)])


def test_placement_keeps_room_for_the_wide_profiles() -> None:
    """Three small instances placed one after another must leave the 4g slot (which can only
    start at slice 0) free: a lowest-slice-first placement would block it."""
    placed: list[Instance] = []
    for _ in range(3):
        start = mig.best_start(A100_40, placed, A100_40.profile("1g.5gb"))
        assert start is not None
        placed.append(Instance("1g.5gb", start))
    assert mig.best_start(A100_40, placed, A100_40.profile("4g.20gb")) == 0


def test_no_start_when_the_card_is_full() -> None:
    full = [Instance("3g.20gb", 0), Instance("3g.20gb", 4)]
    assert mig.best_start(A100_40, full, A100_40.profile("1g.5gb")) is None
    assert mig.free_starts(A100_40, full, A100_40.profile("1g.5gb")) == []


@pytest.mark.parametrize(
    ("model", "memory", "cores", "expected"),
    [
        (A100_80, 5000, 0, "1g.10gb"),
        (A100_80, 10240, 0, "1g.10gb"),
        (A100_80, 10241, 0, "1g.20gb"),
        (A100_80, 15000, 20, "2g.20gb"),
        (A100_80, 30000, 0, "3g.40gb"),
        (A100_80, 1000, 50, "4g.40gb"),
        (A100_80, 41000, 0, "7g.80gb"),
        (A100_80, 1000, 100, "7g.80gb"),
        (A100_80, 90000, 0, None),
        (A30, 7000, 0, "2g.12gb"),
        (A30, 1000, 30, "2g.12gb"),
        (H200, 20000, 0, "1g.35gb"),
    ],
)
def test_smallest_covering_profile(
    model: mig.MigModel, memory: int, cores: int, expected: str | None
) -> None:
    found = mig.smallest_profile(model, memory, cores)
    assert (found.name if found else None) == expected


def test_operator_geometries_restrict_what_may_be_built() -> None:
    allowed = [{"1g.10gb": 7}, {"3g.40gb": 2}]
    assert mig.within_geometries([Instance("1g.10gb", 0)] * 3, allowed)
    assert not mig.within_geometries([Instance("1g.10gb", 0), Instance("3g.40gb", 4)], allowed)
    assert mig.within_geometries([Instance("1g.10gb", 0), Instance("3g.40gb", 4)], None)


@pytest.mark.parametrize(
    ("device_type", "expected"),
    [
        ("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("nvidia-h200", "H200"),
        ("NVIDIA-H100-80GB-HBM3", "H100 80GB HBM3"),
        ("NVIDIA-A30", "A30"),
        ("NVIDIA-Tesla-T4", None),
    ],
)
def test_model_from_the_registered_device_type(device_type: str, expected: str | None) -> None:
    found = mig.model_for(device_type)
    assert (found.name if found else None) == expected


@pytest.mark.parametrize("bad", ["1g", "10gb", "0g.5gb", "1g.5GB+me", ""])
def test_profile_names_are_checked(bad: str) -> None:
    with pytest.raises(MigError, match="not a MIG profile name"):
        mig.parse_profile_name(bad)
