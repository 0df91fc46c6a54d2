"""The DRA driver's settings (`TESSERA_DRA*`), beside the node agent's common ones."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DraSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TESSERA_DRA_", extra="ignore",
                                      populate_by_name=True)  # fmt: skip

    enabled: bool = Field(
        False,
        validation_alias="TESSERA_DRA",
        description="serve this node in DRA mode: a kubelet DRA plugin publishing "
        "ResourceSlices, instead of the device plugin (extender mode)",
    )
    kubelet_dir: str = Field("/var/lib/kubelet", description="kubelet's root directory: "
                             "registration sockets in plugins_registry/, the driver's socket "
                             "in plugins/<driver>/")  # fmt: skip
    cdi_dir: str = Field("/var/run/cdi", description="where the CDI specs of prepared claims go")
    driver_version: str = Field("", description="the NVIDIA driver version published as the "
                                "driverVersion attribute ('' = NVML's, else 0.0.0)")  # fmt: skip
    publish_interval_s: float = Field(
        5.0,
        gt=0,
        description="how often the published slice is "
        "checked against the devices (changes go out at once)",
    )
