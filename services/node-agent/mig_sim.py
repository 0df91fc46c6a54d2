"""Simulated MIG for the static device source (the local stack): GPU + compute instances created
and destroyed as NVML would, with NVML's error codes, for `mig_dynamic.MigReconciler`.

It follows NVIDIA's rules from tessera/mig.py (a profile only at its documented starts, no shared
memory slice, no more compute slices than the card has: NVML_ERROR_INSUFFICIENT_RESOURCES
otherwise) and NVML's destroy contract (NVML_ERROR_IN_USE while a process runs in the instance;
an instance already gone is not an error). Instances live in a JSON file (`state_path`) so they
outlive the agent, as real instances outlive it; a second file, `<state_path>.busy`, lists the
MIG UUIDs a process runs in (a test's stand-in for NVML's process list).
"""

from __future__ import annotations

import json
import os
import threading
import uuid as uuidlib
from pathlib import Path
from typing import Any

import pynvml

from tessera import mig

from .devices import PhysicalGpu
from .nvml_mig import MigDevice, MigNvmlError


class SimulatedMig:
    """The MIG instances of simulated GPUs. Handles are the `PhysicalGpu`s themselves."""

    def __init__(self, gpus: list[PhysicalGpu], state_path: str | None = None) -> None:
        self._gpus = {g.uuid: g for g in gpus}
        self._path = Path(state_path) if state_path else None
        self._lock = threading.Lock()
        self._memory: dict[str, list[dict[str, Any]]] = {}

    @property
    def handles(self) -> dict[str, tuple[object, int]]:
        return {g.uuid: (g, g.index) for g in self._gpus.values()
                if mig.model_for(g.name) is not None}  # fmt: skip

    # --- state ---------------------------------------------------------------------------------

    def _load(self) -> dict[str, list[dict[str, Any]]]:
        if self._path is None:
            return {k: list(v) for k, v in self._memory.items()}
        try:
            data = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self, state: dict[str, list[dict[str, Any]]]) -> None:
        if self._path is None:
            self._memory = state
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, self._path)

    def _busy(self) -> set[str]:
        if self._path is None:
            return set()
        try:
            text = Path(f"{self._path}.busy").read_text()
        except FileNotFoundError:
            return set()
        return {line.strip() for line in text.splitlines() if line.strip()}

    def _model(self, gpu: PhysicalGpu) -> mig.MigModel:
        model = mig.model_for(gpu.name)
        if model is None:
            raise MigNvmlError(f"{gpu.name} has no MIG", pynvml.NVML_ERROR_NOT_SUPPORTED)
        return model

    # --- the three calls the reconciler makes ----------------------------------------------------

    def list_devices(self, handle: object, parent_index: int) -> list[MigDevice]:
        gpu = handle if isinstance(handle, PhysicalGpu) else self._gpus[str(handle)]
        model = mig.model_for(gpu.name)
        if model is None:
            return []
        with self._lock:
            items = self._load().get(gpu.uuid, [])
        return [
            MigDevice(parent_uuid=gpu.uuid, parent_index=parent_index, uuid=i["uuid"],
                      profile=i["profile"], gi_id=i["gi_id"], ci_id=0, start=i["start"],
                      memory_mib=model.profile_memory_mib(model.profile(i["profile"])))
            for i in sorted(items, key=lambda i: i["gi_id"])
        ]  # fmt: skip

    def create(self, handle: object, parent_index: int, profile_name: str, start: int
               ) -> MigDevice:
        gpu = handle if isinstance(handle, PhysicalGpu) else self._gpus[str(handle)]
        model = self._model(gpu)
        try:
            profile = model.profile(profile_name)
        except mig.MigError as exc:
            raise MigNvmlError(str(exc), pynvml.NVML_ERROR_INVALID_ARGUMENT) from exc
        with self._lock:
            state = self._load()
            items = state.setdefault(gpu.uuid, [])
            existing = [mig.Instance(i["profile"], i["start"]) for i in items]
            if start not in mig.free_starts(model, existing, profile):
                raise MigNvmlError(
                    f"creating GPU instance {profile_name} at slice {start}: Insufficient "
                    "Resources", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            taken = {i["gi_id"] for i in items}
            gi_id = next(n for n in range(1, 64) if n not in taken)
            items.append({"gi_id": gi_id, "profile": profile.name, "start": start,
                          "uuid": f"MIG-{uuidlib.uuid4()}"})  # fmt: skip
            self._save(state)
        return next(d for d in self.list_devices(gpu, parent_index) if d.gi_id == gi_id)

    def destroy(self, handle: object, gi_id: int) -> None:
        gpu = handle if isinstance(handle, PhysicalGpu) else self._gpus[str(handle)]
        with self._lock:
            state = self._load()
            items = state.get(gpu.uuid, [])
            target = next((i for i in items if i["gi_id"] == gi_id), None)
            if target is None:
                return  # already gone
            if target["uuid"] in self._busy():
                raise MigNvmlError(f"destroying GPU instance {gi_id}: In use by another client",
                                   pynvml.NVML_ERROR_IN_USE)
            state[gpu.uuid] = [i for i in items if i["gi_id"] != gi_id]
            self._save(state)
