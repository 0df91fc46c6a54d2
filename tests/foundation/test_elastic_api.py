"""tessera/elastic.py, the elastic user API (issue 33): the annotations' forms, and the
scheduler's record of the burst granted (written at bind, read back by a ledger rebuild)."""

from __future__ import annotations

import pytest

from tessera import elastic
from tessera.models import DeviceGrant


def test_pod_wide_and_per_container_forms() -> None:
    names = ["init", "train", "side"]
    opts = elastic.parse_elastic({elastic.ANN_GPUMEM_LIMIT: "8000"}, names)
    assert set(opts.limits) == set(names) and opts.named == frozenset()
    opts = elastic.parse_elastic({elastic.ANN_GPUMEM_LIMIT: "train=50%, side=900",
                                  elastic.ANN_GPUCORES_LIMIT: "train=80"}, names)  # fmt: skip
    assert opts.limits["train"] == elastic.BurstLimit(0, 50, 80)
    assert opts.limits["side"] == elastic.BurstLimit(900, None, 0)
    assert "init" not in opts.limits and opts.named == {"train", "side"}
    assert (opts.reclaim, opts.wait_s) == ("fail", 0.0)


@pytest.mark.parametrize("value", ["", "train=", "=5", "train=1,train=2", "x=1", "0", "1.5"])
def test_malformed_limits_are_refused(value: str) -> None:
    with pytest.raises(elastic.ElasticError):
        elastic.parse_elastic({elastic.ANN_GPUMEM_LIMIT: value}, ["train"])


def test_the_record_round_trips_and_a_mismatch_is_ignored() -> None:
    g = DeviceGrant(uuid="GPU-a", type="T", memory_mib=4096, cores=20, memory_limit_mib=12288,
                    cores_limit=90)  # fmt: skip
    h = DeviceGrant(uuid="GPU-b", type="T", memory_mib=1000, cores=10)
    text = elastic.encode_burst([[g, h], []])
    assert text == "GPU-a,12288,90:GPU-b,0,0:;;"
    plain = [[g.model_copy(update={"memory_limit_mib": 0, "cores_limit": 0}), h], []]
    assert elastic.with_burst(plain, text) == [[g, h], []]
    assert elastic.with_burst(plain, "GPU-z,12288,90:GPU-b,0,0:;;") == plain  # another card
    assert elastic.with_burst(plain, "garbage") == plain
    assert elastic.encode_burst([[h]]) is None  # hard slices: no record at all
    with pytest.raises(ValueError):
        elastic.decode_burst("GPU-a,99999999999,0:;")
