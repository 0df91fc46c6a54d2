"""Config lines for the fake NVML's MIG part (fake_nvml_mig.c), generated from tessera/mig.py so
the fake's profile table and the scheduler's can never disagree."""

from __future__ import annotations

from tessera import mig

# The profile ids `nvidia-smi mig -lgip` prints (what nvmlDeviceGetGpuInstanceProfileInfo
# reports as `id`), by (compute slices, memory slices) on 8-slice cards and on the A30.
_IDS_8 = {(1, 1): 19, (1, 2): 15, (2, 2): 14, (3, 4): 9, (4, 4): 5, (7, 8): 0}
_IDS_A30 = {(1, 1): 14, (2, 2): 5, (4, 4): 0}


def profile_id(model: mig.MigModel, profile: mig.MigProfile) -> int:
    table = _IDS_A30 if model.memory_slices == 4 else _IDS_8
    return table[(profile.compute_slices, profile.memory_slices)]


def gpu_lines(gpu: int, model: mig.MigModel) -> str:
    """The `giprofile` lines of GPU `gpu` of `model`."""
    return "".join(
        f"giprofile {gpu} {mig.nvml_profile_index(model, p)} {profile_id(model, p)} "
        f"{p.compute_slices} {p.memory_slices} {model.profile_memory_mib(p)} {p.name} "
        f"{','.join(map(str, p.starts))}\n"
        for p in model.profiles
    )


def instance_line(gpu: int, model: mig.MigModel, profile: str, start: int) -> str:
    """A `gi` line: an instance (with its compute instance) present when NVML starts."""
    return f"gi {gpu} {mig.nvml_profile_index(model, model.profile(profile))} {start}\n"
