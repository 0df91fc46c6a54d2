"""The Python mirror of tessera_region.h matches the C layout, field for field."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tessera import region

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = ROOT / "native" / "libvgpu" / "include"

STRUCTS = {
    "struct tsr_limits_device": region.LimitsDeviceC,
    "struct tsr_limits": region.LimitsC,
    "struct tsr_region_device": region.RegionDeviceC,
    "struct tsr_proc_slot": region.ProcSlotC,
    "struct tsr_region": region.RegionC,
}
CONSTANTS = {
    "TSR_LIMITS_MAGIC": region.LIMITS_MAGIC,
    "TSR_REGION_MAGIC": region.REGION_MAGIC,
    "TSR_VERSION_MAJOR": region.VERSION_MAJOR,
    "TSR_VERSION_MINOR": region.VERSION_MINOR,
    "TSR_LIMITS_VERSION_MINOR": region.LIMITS_VERSION_MINOR,
    "TSR_SM_ALLOW_FULL": region.SM_ALLOW_FULL,
    "TSR_MAX_DEVICES": region.MAX_DEVICES,
    "TSR_MAX_PROCS": region.MAX_PROCS,
    "TSR_UUID_LEN": region.UUID_LEN,
    "TSR_PATH_LEN": region.PATH_LEN,
    "TSR_POLICY_DEFAULT": region.POLICY_DEFAULT,
    "TSR_POLICY_FORCE": region.POLICY_FORCE,
    "TSR_POLICY_DISABLE": region.POLICY_DISABLE,
    "TSR_LIMITS_SCRUB_ON_FREE": region.LIMITS_SCRUB_ON_FREE,
    "TSR_LIMITS_OVERSUBSCRIBE": region.LIMITS_OVERSUBSCRIBE,
    "TSR_LIMITS_LEASE": region.LIMITS_LEASE,
    "TSR_LEASE_CHUNK": region.LEASE_CHUNK,
    "TSR_DEV_CONTENDED": region.DEV_CONTENDED,
    "TSR_DEV_YIELD": region.DEV_YIELD,
    "TSR_SM_UNKNOWN": region.SM_UNKNOWN,
    "TSR_LIMITS_POLL_MS": region.LIMITS_POLL_MS,
}
STRINGS = {
    "TSR_SEALED_LIMITS_DIR": region.SEALED_LIMITS_DIR,
    "TSR_LIMITS_FILE_NAME": region.LIMITS_FILE_NAME,
    "TSR_LEASE_SOCKET_NAME": region.LEASE_SOCKET_NAME,
    "TSR_LEASE_SPILL_NAME": region.LEASE_SPILL_NAME,
    "TSR_ENV_LIMITS_DIR": region.ENV_LIMITS_DIR,
    "TSR_ENV_REGION_PATH": region.ENV_REGION_PATH,
}


def _c_program() -> str:
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        '#include "tessera_region.h"',
        "int main(void) {",
    ]
    for cname, py in STRUCTS.items():
        lines.append(f'printf("sizeof {cname} %zu\\n", sizeof({cname}));')
        lines.append(f'printf("alignof {cname} %zu\\n", _Alignof({cname}));')
        for fname, *_ in py._fields_:
            lines.append(f'printf("offsetof {cname}.{fname} %zu\\n", offsetof({cname}, {fname}));')
            lines.append(
                f'printf("sizeof {cname}.{fname} %zu\\n", sizeof((({cname} *)0)->{fname}));'
            )
    for name in CONSTANTS:
        lines.append(f'printf("const {name} %llu\\n", (unsigned long long)({name}));')
    for name in STRINGS:
        lines.append(f'printf("str {name} %s\\n", {name});')
    lines += ["return 0;", "}"]
    return "\n".join(lines)


def _expected() -> dict[str, str]:
    out = {}
    for cname, py in STRUCTS.items():
        out[f"sizeof {cname}"] = str(ctypes.sizeof(py))
        out[f"alignof {cname}"] = str(ctypes.alignment(py))
        for fname, *_ in py._fields_:
            desc = getattr(py, fname)
            out[f"offsetof {cname}.{fname}"] = str(desc.offset)
            out[f"sizeof {cname}.{fname}"] = str(desc.size)
    for name, value in CONSTANTS.items():
        out[f"const {name}"] = str(value)
    for name, value in STRINGS.items():
        out[f"str {name}"] = value
    return out


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_python_mirror_matches_c_header(tmp_path):
    src = tmp_path / "layout.c"
    src.write_text(_c_program())
    exe = tmp_path / "layout"
    subprocess.run(
        [
            "cc",
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
            str(INCLUDE),
            str(src),
            "-o",
            str(exe),
        ],
        check=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = dict(line.rsplit(" ", 1) for line in out.splitlines())
    assert got == _expected()


def test_every_c_field_is_mirrored():
    """A field added to the header must be added to the mirror (names compared textually)."""
    text = (INCLUDE / "tessera_region.h").read_text()
    for cname, py in STRUCTS.items():
        tag = cname.split()[1]
        body = re.search(r"struct " + tag + r" \{(.*?)\n\};", text, re.S).group(1)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        body = re.sub(r"union \{.*?\}\s*(\w+);", r"union \1;", body, flags=re.S)
        names = re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*;", body)
        assert names == [f for f, *_ in py._fields_], cname


def test_limits_roundtrip_and_checksum(tmp_path):
    lim = region.ContainerLimits(
        devices=(
            region.DeviceLimit("GPU-aaaa", mem_limit_bytes=4000 << 20, sm_limit_pct=30),
            region.DeviceLimit("GPU-bbbb", mem_limit_bytes=0, sm_limit_pct=0, contended=True),
        ),
        priority=0,
        core_policy="force",
        scrub_on_free=True,
        region_path="/tmp/r.cache",
    )
    sealed = region.seal_limits(tmp_path, lim)
    assert sealed.generation == 1
    back = region.read_limits(tmp_path)
    assert back == sealed
    assert oct((tmp_path / "limits").stat().st_mode & 0o777) == "0o444"
    assert region.set_device_flags(tmp_path, "GPU-aaaa", contended=True) is True
    assert region.set_device_flags(tmp_path, "GPU-aaaa", contended=True) is False
    again = region.read_limits(tmp_path)
    assert again.generation == 2 and again.device("GPU-aaaa").contended
    data = bytearray((tmp_path / "limits").read_bytes())
    data[100] ^= 0xFF
    with pytest.raises(region.RegionFormatError):
        region.decode_limits(bytes(data))
    assert list(tmp_path.iterdir()) == [tmp_path / "limits"]  # no temp files left behind


def _old_limits_file(lim: region.ContainerLimits, minor: int, junk: bool) -> bytes:
    """The bytes a writer of limits 1.<minor> produced (its reserved space possibly not zero)."""
    c = region.LimitsC.from_buffer_copy(region.encode_limits(lim))
    c.minor = minor
    for e in c.dev:
        e.sm_burst_pct, e.mem_burst_bytes, e.sm_allow_x100 = (
            (100, 1 << 40, 9000) if junk else (0, 0, 0)
        )
    raw = bytes(c)
    c.checksum = region.fnv1a64(raw[: region.LimitsC.checksum.offset])
    return bytes(c)


@pytest.mark.parametrize("minor,junk", [(0, False), (1, False), (1, True)])
def test_limits_before_1_2_read_as_hard_slices(minor, junk):
    """A limits file sealed before the elastic fields existed is a hard slice: whatever an old
    writer left in the bytes that were reserved then, no burst and no allowance."""
    lim = region.ContainerLimits(devices=(region.DeviceLimit("GPU-a", 4000 << 20, 30),))
    back = region.decode_limits(_old_limits_file(lim, minor, junk)).device("GPU-a")
    assert (back.mem_limit_bytes, back.sm_limit_pct) == (4000 << 20, 30)
    assert (back.mem_burst_bytes, back.sm_burst_pct, back.sm_allow_x100) == (0, 0, 0)
    assert not back.sm_elastic and not back.mem_elastic
    assert back.mem_burst_limit_bytes == 4000 << 20 and back.sm_burst_limit_pct == 30


def test_guarantee_and_burst_roundtrip(tmp_path):
    dev = region.device_limit(
        "GPU-a", mem_guarantee_bytes=4 << 30, mem_burst_bytes=12 << 30,
        sm_guarantee_pct=10, sm_burst_pct=100,
    )
    assert dev.mem_elastic and dev.sm_elastic
    assert (dev.mem_guarantee_bytes, dev.mem_burst_limit_bytes) == (4 << 30, 12 << 30)
    assert (dev.sm_guarantee_pct, dev.sm_burst_limit_pct) == (10, 100)
    region.seal_limits(tmp_path, region.ContainerLimits(devices=(dev,)))
    c = region.LimitsC.from_buffer_copy((tmp_path / "limits").read_bytes())
    assert (c.major, c.minor) == (1, region.LIMITS_VERSION_MINOR)
    assert region.set_device_flags(tmp_path, "GPU-a", sm_allow_x100=7500) is True
    back = region.read_limits(tmp_path).device("GPU-a")
    assert back == region.DeviceLimit(
        "GPU-a", 4 << 30, 10, mem_burst_bytes=12 << 30, sm_burst_pct=100, sm_allow_x100=7500
    )
    # A burst equal to the guarantee (or none) is today's hard slice, byte for byte.
    hard = region.device_limit("GPU-a", mem_guarantee_bytes=4 << 30, mem_burst_bytes=4 << 30,
                               sm_guarantee_pct=30, sm_burst_pct=30)
    assert hard == region.DeviceLimit("GPU-a", 4 << 30, 30)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mem_guarantee_bytes": 8 << 30, "mem_burst_bytes": 4 << 30},
        {"mem_guarantee_bytes": 0, "mem_burst_bytes": 4 << 30},
        {"sm_guarantee_pct": 30, "sm_burst_pct": 20},
        {"sm_guarantee_pct": 30, "sm_burst_pct": 101},
        {"sm_guarantee_pct": 0, "sm_burst_pct": 50},
    ],
)
def test_burst_below_or_without_guarantee_is_refused(kwargs):
    with pytest.raises(ValueError, match="GPU-a"):
        region.device_limit("GPU-a", **kwargs)


def test_activity_flags_policy():
    now = 10_000_000_000
    flags = region.activity_flags(
        [
            region.ContainerActivity("hi", 0, now - 100_000_000),
            region.ContainerActivity("lo", 1, now - 50_000_000),
            region.ContainerActivity("idle", 1, now - 5_000_000_000),
        ],
        now_ns=now,
    )
    assert flags["hi"] == region.ActivityFlags(contended=True, yield_=False)
    assert flags["lo"] == region.ActivityFlags(contended=True, yield_=True)
    assert flags["idle"] == region.ActivityFlags(contended=True, yield_=True)
    alone = region.activity_flags([region.ContainerActivity("a", 1, now)], now_ns=now)
    assert alone["a"] == region.ActivityFlags(contended=False, yield_=False)


def test_read_region_absent_or_empty(tmp_path):
    assert region.read_region(tmp_path / "none") is None
    (tmp_path / "empty").touch()
    assert region.read_region(tmp_path / "empty") is None
    region.prepare_region_file(tmp_path / "r")  # a valid header, nothing charged yet
    u = region.read_region(tmp_path / "r")
    assert u is not None and u.devices == () and u.processes == ()
    region.RegionC.from_buffer_copy((tmp_path / "r").read_bytes())  # exactly the C size
