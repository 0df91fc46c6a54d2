"""migstrategy single on a real GPU node (gpu-check.sh, section 10b): the agent's NVML source
(services/node-agent/nvml.py) discovers the GPUs and their MIG instances, and NVIDIA's single
rule (mig_static.single_devices) turns them into the devices the node would advertise as
`nvidia.com/gpu`. With MIG off on every GPU it is skipped (it never changes the MIG mode).

Passes when the rule is applied consistently with what NVML shows: every GPU in MIG mode with
instances of one profile → one device per instance (its MIG UUID, split count 1, memory no more
than the profile's table share and at least what NVML gives the instance × 0.85); otherwise no
device and a reason. Prints one JSON line; exit 0 on agreement, 1 otherwise.
"""

from __future__ import annotations

import json
import sys

from tessera.node_agent import mig_static
from tessera.node_agent.nvml import NvmlSource

from tessera.settings import TesseraSettings


def main() -> int:
    source = NvmlSource(TesseraSettings())
    try:
        gpus = source.discover()
        if not any(g.mig for g in gpus):
            print(json.dumps({"skipped": "no GPU in MIG mode"}))
            return 0
        offers = source.mig_offers()
        devices, problem = mig_static.single_devices(gpus, offers)
        profiles = sorted({o.profile for o in offers})
        problems: list[str] = []
        uniform = all(g.mig for g in gpus) and len(profiles) == 1
        devices = devices or []
        if uniform:
            if problem or len(devices) != len(offers):
                problems.append(f"one profile on every GPU, yet {len(devices)} devices for "
                                f"{len(offers)} instances: {problem}")
            for d in devices:
                if not d.uuid.startswith("MIG-") or d.split_count != 1 or d.memory_mib <= 0:
                    problems.append(f"device {d.uuid}: split {d.split_count}, {d.memory_mib} MiB")
        elif devices or not problem:
            problems.append(f"profiles {profiles} on mixed GPUs, yet {len(devices)} devices")
        print(json.dumps({"gpus": len(gpus), "instances": len(offers), "profiles": profiles,
                          "devices": [(d.uuid, d.type, d.memory_mib) for d in devices],
                          "refused": problem, "problems": problems}))
        return 1 if problems else 0
    finally:
        source.close()


if __name__ == "__main__":
    sys.exit(main())
