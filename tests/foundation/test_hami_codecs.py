"""HAMi encodings: the exact examples of specs/hami-compat.md, properties, and bad input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.hami import (
    ContainerRequest,
    RequestError,
    decode_node_register,
    decode_pod_devices,
    encode_node_register,
    encode_pod_devices,
    parse_container_request,
    parse_pod_request,
    parse_quantity,
    parse_scoring_weights,
    quota_charge,
    scheduler_owned,
)
from tessera.models import DeviceGrant, DeviceInfo
from tessera.settings import TesseraSettings

SPEC_EXAMPLE = "GPU-aaa,NVIDIA,3000,30:;;GPU-bbb,NVIDIA,5000,0:GPU-ccc,NVIDIA,5000,0:;"


def container(limits: dict[str, object], name: str = "c") -> dict[str, object]:
    return {"name": name, "resources": {"limits": limits}}


@pytest.fixture
def s() -> TesseraSettings:
    return TesseraSettings()


def test_spec_example_of_devices_to_allocate_decodes_positionally() -> None:
    containers = decode_pod_devices(SPEC_EXAMPLE)
    assert [[d.uuid for d in c] for c in containers] == [["GPU-aaa"], [], ["GPU-bbb", "GPU-ccc"]]
    assert containers[0][0] == DeviceGrant(uuid="GPU-aaa", type="NVIDIA", memory_mib=3000, cores=30)
    assert encode_pod_devices(containers) == SPEC_EXAMPLE


grants = st.lists(
    st.lists(
        st.builds(
            DeviceGrant,
            uuid=st.from_regex(r"GPU-[0-9a-f\-]{1,36}", fullmatch=True),
            type=st.from_regex(r"NVIDIA(-[A-Za-z0-9]{1,8}){0,3}", fullmatch=True),
            memory_mib=st.integers(0, 10**7),
            cores=st.integers(0, 100),
        ),
        max_size=4,
    ),
    max_size=5,
)


@given(grants)
def test_devices_annotation_round_trips(containers: list[list[DeviceGrant]]) -> None:
    assert decode_pod_devices(encode_pod_devices(containers)) == containers


@pytest.mark.parametrize(
    "bad",
    [
        "GPU-a,NVIDIA,3000,30:",
        "GPU-a,NVIDIA,3000:;",
        "GPU-a,NVIDIA,x,30:;",
        "GPU-a,NVIDIA,1,2;",
    ],
)
def test_malformed_devices_annotation_is_an_error(bad: str) -> None:
    with pytest.raises(ValueError):
        decode_pod_devices(bad)


def test_separator_in_a_device_field_is_refused() -> None:
    with pytest.raises(ValueError, match="separator"):
        encode_pod_devices([[DeviceGrant(uuid="GPU:1", type="NVIDIA", memory_mib=1, cores=1)]])


devices = st.lists(
    st.builds(
        DeviceInfo,
        uuid=st.from_regex(r"GPU-[0-9a-f]{4,12}", fullmatch=True),
        index=st.integers(0, 16),
        type=st.from_regex(r"NVIDIA-[A-Z0-9]{2,8}", fullmatch=True),
        memory_mib=st.integers(0, 10**6),
        cores=st.integers(0, 400),
        split_count=st.integers(1, 64),
        numa=st.integers(0, 7),
        healthy=st.booleans(),
        mode=st.sampled_from(["hami-core", "mig", "mps"]),
    ),
    max_size=8,
)


@given(devices)
def test_node_register_json_round_trips(devs: list[DeviceInfo]) -> None:
    assert decode_node_register(encode_node_register(devs)) == devs


def test_node_register_json_has_hamis_keys() -> None:
    text = encode_node_register(
        [
            DeviceInfo(
                uuid="GPU-1", index=0, type="NVIDIA-H200", memory_mib=143771, split_count=10, numa=1
            )
        ]
    )
    assert json.loads(text) == [
        {
            "id": "GPU-1",
            "index": 0,
            "count": 10,
            "devmem": 143771,
            "devcore": 100,
            "type": "NVIDIA-H200",
            "numa": 1,
            "mode": "hami-core",
            "health": True,
        }
    ]


def test_node_register_legacy_form_is_accepted() -> None:
    legacy = "GPU-a,10,81920,100,NVIDIA-A100,0,true:GPU-b,10,81920,100,NVIDIA-A100,1,false,1,mig:"
    a, b = decode_node_register(legacy)
    assert (a.uuid, a.split_count, a.memory_mib, a.numa, a.healthy, a.index) == (
        "GPU-a",
        10,
        81920,
        0,
        True,
        0,
    )
    assert (b.healthy, b.index, b.mode) == (False, 1, "mig")
    with pytest.raises(ValueError):
        decode_node_register("GPU-a,10,notanumber,100,NVIDIA,0,true")


def test_request_parsing_follows_hamis_rules(s: TesseraSettings) -> None:
    # gpumem in MiB, count from limits, cores as given.
    r = parse_container_request(
        container({"nvidia.com/gpu": 1, "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}),
        s,
    )
    assert r == ContainerRequest(count=1, memory_mib=3000, memory_percentage=None, cores=30)
    # Neither memory nor percentage: 100 % of the card; a bare count is an exclusive card
    # only once admission adds gpucores 100 (the default cores are defaultCores = 0 here).
    r = parse_container_request(container({"nvidia.com/gpu": "2"}), s)
    assert (r.count, r.memory_percentage, r.cores) == (2, 100, 0)
    assert r.memory_on(81920) == 81920
    # Percentage > 100 clamps; <= 0 is ignored (= unset: the card's memory).
    assert (
        parse_container_request(
            container({"nvidia.com/gpumem-percentage": 150}), s
        ).memory_percentage
        == 100
    )
    r = parse_container_request(container({"nvidia.com/gpumem-percentage": 0}), s)
    assert r.memory_percentage == 100 and r.count == 1  # count added: defaultGPUNum
    # Cores above 100 clamp; memory without a count gets defaultGPUNum.
    r = parse_container_request(
        container({"nvidia.com/gpumem": 1024, "nvidia.com/gpucores": 250}), s
    )
    assert (r.count, r.memory_mib, r.cores) == (1, 1024, 100)
    # requests are read when limits do not say.
    r = parse_container_request({"name": "x", "resources": {"requests": {"nvidia.com/gpu": 1}}}, s)
    assert r is not None and r.count == 1
    assert parse_container_request(container({"cpu": "1"}), s) is None


def test_defaults_apply(s: TesseraSettings) -> None:
    custom = TesseraSettings(default_mem=2048, default_cores=20, default_gpu_num=2)
    r = parse_container_request(container({"nvidia.com/gpucores": 10}), custom)
    assert (r.count, r.memory_mib, r.memory_percentage, r.cores) == (2, 2048, None, 10)
    r = parse_container_request(container({"nvidia.com/gpu": 1}), custom)
    assert r.cores == 20


def test_configured_resource_names_are_honoured() -> None:
    custom = TesseraSettings(resource_name="example.com/vgpu", resource_mem="example.com/vmem")
    r = parse_container_request(container({"example.com/vgpu": 1, "example.com/vmem": 500}), custom)
    assert (r.count, r.memory_mib) == (1, 500)
    assert parse_container_request(container({"nvidia.com/gpu": 1}), custom) is None


@pytest.mark.parametrize(
    "limits, message",
    [
        ({"nvidia.com/gpumem": "-1"}, "at least 0"),
        ({"nvidia.com/gpumem": "1.5"}, "whole number"),
        ({"nvidia.com/gpumem": "1e400"}, "absurdly large"),
        ({"nvidia.com/gpumem": "abc"}, "not a quantity"),
        ({"nvidia.com/gpumem": "12Zi"}, "not a quantity"),
        ({"nvidia.com/gpumem": True}, "not a quantity"),
        ({"nvidia.com/gpumem": None}, "not a quantity"),
        ({"nvidia.com/gpu": "-2"}, "at least 0"),
        ({"nvidia.com/gpu": "1000000"}, "absurdly large"),
        ({"nvidia.com/gpumem-percentage": "ten"}, "not a quantity"),
        ({"nvidia.com/gpu": 1, "nvidia.com/priority": 7}, "at most 1"),
    ],
)
def test_bad_quantities_give_a_clear_error(s: TesseraSettings, limits: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        parse_container_request(container(limits, name="trainer"), s)
    assert "container trainer" in str(err.value)


@given(st.one_of(st.text(max_size=30), st.integers(), st.floats(), st.none(), st.booleans()))
def test_quantity_parser_never_crashes(value: object) -> None:
    """Any input either parses to a finite number or raises RequestError, nothing else."""
    try:
        parsed = parse_quantity(value)
    except RequestError as exc:
        assert "quantity" in str(exc)
    else:
        assert parsed.is_finite()


def test_quantity_suffixes() -> None:
    assert parse_quantity("2Gi") == 2 * 1024**3
    assert parse_quantity("500m") * 2 == 1
    assert parse_quantity("1e3") == 1000
    assert parse_quantity("3k") == 3000


def test_quota_charge_sums_app_containers_and_takes_the_init_peak(s: TesseraSettings) -> None:
    pod = {
        "spec": {
            "initContainers": [
                container(
                    {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 6000, "nvidia.com/gpucores": 50},
                    "init",
                )
            ],
            "containers": [
                container(
                    {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 2000, "nvidia.com/gpucores": 10}, "a"
                ),
                container({"cpu": "1"}, "b"),
            ],
        }
    }
    request = parse_pod_request(pod, s)
    assert request.wants_gpu and len(request.all) == 3 and request.all[2] is None
    # 2 GPUs × 2000 MiB = 4000 (spec example); the init container's 6000 is the peak.
    assert quota_charge(request) == (6000, 50, 2)


def test_scoring_weights() -> None:
    assert parse_scoring_weights("slot=1,core=1,memory=3") == (1, 1, 3)
    for bad in (
        "slot=1,core=1",
        "slot=0,core=0,memory=0",
        "slot=-1,core=1,memory=1",
        "slot=1,core=1,memory=x",
        "gpu=1,core=1,memory=1",
    ):
        with pytest.raises(RequestError):
            parse_scoring_weights(bad)


def test_scheduler_owned_annotations() -> None:
    assert scheduler_owned("hami.io/vgpu-devices-to-allocate")
    assert scheduler_owned("hami.io/bind-phase")
    assert not scheduler_owned("hami.io/gpu-scheduler-policy")
    assert not scheduler_owned("nvidia.com/use-gputype")
