"""The driver's opaque device configuration: how a claim's devices are shared (pure).

A claim (or its DeviceClass) carries configuration for this driver as
`DeviceClaimConfiguration.opaque` / `DeviceClassConfiguration.opaque` with `driver:
gpu.tessera.io`; the allocator copies both into `status.allocation.devices.config` (`source:
FromClass` first, then `FromClaim`), each naming the requests it applies to (none: all). For
one request, later entries override earlier ones, so a claim's own configuration beats its
class's. The parameters are validated here as anything from the network:

```yaml
apiVersion: gpu.tessera.io/v1alpha1
kind: GpuConfig
sharing:
  strategy: MPS          # or TimeSlicing (libvgpu's time-based compute limit)
```

- `TimeSlicing`: the slice as ever, libvgpu enforcing memory and compute;
- `MPS`: the container gets its own MPS control daemon (as in extender mode, services/node-agent
  /mps.py) whose server holds the claim's memory and compute share, its pipe directory mounted;
  libvgpu keeps the memory limit and leaves compute to MPS.

No configuration: the card's mode decides (`mps` cards: MPS; others: TimeSlicing). Cards are
never mixed: MPS on a card that is not in MPS mode, or TimeSlicing on one that is, is refused
with a sentence (the DeviceClass `mps.gpu.tessera.io` selects the MPS cards and configures MPS).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera import dra_names as names

TIME_SLICING = "TimeSlicing"
MPS = "MPS"


class Sharing(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: Literal["TimeSlicing", "MPS"]


class GpuConfig(BaseModel):
    """The parameters of one opaque configuration entry for this driver."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["gpu.tessera.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["GpuConfig"]
    sharing: Sharing | None = None


class ConfigError(ValueError):
    """A configuration entry this driver cannot apply; the message says which and why."""


def parse(parameters: Any, where: str) -> GpuConfig:
    if not isinstance(parameters, dict):
        raise ConfigError(f"{where}: parameters must be an object "
                          f"(apiVersion: {names.CONFIG_API_VERSION}, kind: {names.CONFIG_KIND})")
    try:
        return GpuConfig.model_validate(parameters)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'parameters'}: {e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(f"{where}: {problems} (expected apiVersion "
                          f"{names.CONFIG_API_VERSION}, kind {names.CONFIG_KIND}, "
                          "sharing.strategy TimeSlicing or MPS)") from None


def _applies(entry: dict[str, Any], request: str) -> bool:
    """Whether a config entry names the request (`gpu`, or `gpu/<subrequest>` of a
    firstAvailable request, which an entry naming `gpu` covers too)."""
    requests = entry.get("requests") or []
    if not requests:
        return True
    main = request.split("/", 1)[0]
    return request in requests or main in requests


def strategy_for(allocation: dict[str, Any], request: str, where: str) -> str | None:
    """The sharing strategy the allocation's configuration sets for `request` (None: none)."""
    entries = ((allocation.get("devices") or {}).get("config") or []) if isinstance(
        allocation, dict) else []  # fmt: skip
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: status.allocation.devices.config is not a list")
    ordered = [e for e in entries if isinstance(e, dict) and e.get("source") == "FromClass"] + [
        e for e in entries if isinstance(e, dict) and e.get("source") != "FromClass"]
    found: str | None = None
    for entry in ordered:
        opaque = entry.get("opaque")
        if not isinstance(opaque, dict) or opaque.get("driver") != names.DRIVER_NAME:
            continue  # another driver's configuration
        if not _applies(entry, request):
            continue
        parsed = parse(opaque.get("parameters"), f"{where} config ({entry.get('source', '')})")
        if parsed.sharing is not None:
            found = parsed.sharing.strategy
    return found


def check(strategy: str | None, mode: str, device: str, where: str) -> str:
    """The strategy a device is prepared with; ConfigError when it does not suit the card."""
    if mode == "mig":
        if strategy == MPS:
            raise ConfigError(f"{where}: MPS sharing is configured, but {device} is a MIG "
                              "instance (the hardware isolates it; MPS inside one is not "
                              "offered)")  # fmt: skip
        return TIME_SLICING
    effective = strategy or (MPS if mode == "mps" else TIME_SLICING)
    if effective == MPS and mode != "mps":
        raise ConfigError(
            f"{where}: MPS sharing is configured, but {device} is not in MPS mode (its node's "
            f"operatingmode is {mode}); ask DeviceClass {names.MPS_DEVICE_CLASS}, which selects "
            "the MPS cards")
    if effective == TIME_SLICING and mode == "mps":
        raise ConfigError(
            f"{where}: TimeSlicing is configured, but {device} is in MPS mode (modes are never "
            f"mixed on one card); ask DeviceClass {names.DEVICE_CLASS} for libvgpu slices")
    return effective
