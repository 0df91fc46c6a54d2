"""MIG on a real GPU (gpu-check.sh, section 10): does NVIDIA's driver agree with tessera/mig.py?

For GPU 0: every profile Tessera knows for the model must exist in NVML with the same compute
slices and placements (start, size), and memory no larger than the profile's share of the card
(NVML reports somewhat less: firmware reserves some). When MIG mode is already on, the node
agent's discovery (nvml_mig.list_devices) runs; with TESSERA_GPU_CHECK_MIG_CREATE=1 it also
creates the smallest profile's instance and destroys it again. It never changes the MIG mode.
Prints one JSON line; exit 0 when everything checked agrees (or MIG does not apply), 1 otherwise.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import pynvml

from tessera import mig


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def main() -> int:
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = _text(pynvml.nvmlDeviceGetName(handle))
        model = mig.model_for(name)
        if model is None:
            print(json.dumps({"skipped": f"{name} has no MIG profiles in tessera/mig.py"}))
            return 0
        problems: list[str] = []
        for profile in model.profiles:
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
                    handle, mig.nvml_profile_index(model, profile), version=1)
            except pynvml.NVMLError as exc:
                problems.append(f"{profile.name}: NVML has no such profile ({exc})")
                continue
            if info.sliceCount != profile.compute_slices:
                problems.append(f"{profile.name}: NVML says {info.sliceCount} compute slices")
            share = model.profile_memory_mib(profile)
            if not 0.85 * share <= info.memorySizeMB <= share:
                problems.append(f"{profile.name}: NVML memory {info.memorySizeMB} MiB vs {share}")
            count = ctypes.c_uint(0)
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, None,
                                                              ctypes.byref(count))
            places = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, places,
                                                              ctypes.byref(count))
            got = [(p.start, p.size) for p in places[: count.value]]
            want = [(s, profile.memory_slices) for s in profile.starts]
            if got != want:
                problems.append(f"{profile.name}: NVML placements {got}, table {want}")
        result: dict[str, object] = {"gpu": name, "profiles": len(model.profiles),
                                     "problems": problems}
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        result["mig_mode"] = int(current)
        if current == pynvml.NVML_DEVICE_MIG_ENABLE:
            from tessera.node_agent import nvml_mig

            result["instances"] = [(d.profile, d.start, d.uuid)
                                   for d in nvml_mig.list_devices(handle, 0)]
            if os.environ.get("TESSERA_GPU_CHECK_MIG_CREATE") == "1":
                held = [mig.Instance(p, s) for p, s, _ in result["instances"]]  # type: ignore[misc]
                smallest = model.profiles[0]
                start = mig.best_start(model, held, smallest)
                if start is None:
                    problems.append("no room for a test instance")
                else:
                    dev = nvml_mig.create(handle, 0, smallest.name, start)
                    nvml_mig.destroy(handle, dev.gi_id)
                    gone = all(d.uuid != dev.uuid for d in nvml_mig.list_devices(handle, 0))
                    result["created"] = dev.uuid
                    if not dev.uuid.startswith("MIG-") or not gone:
                        problems.append(f"create/destroy: {dev.uuid}, destroyed={gone}")
        print(json.dumps(result))
        return 1 if problems else 0
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
