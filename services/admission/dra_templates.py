"""The I/O half of the DRA conversion: card sizes from the published ResourceSlices, the
ResourceClaimTemplates created through the cluster port, and the final JSON patch."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from tessera.cluster.port import ClusterError, ConflictError
from tessera.quantity import QuantityError, parse
from tessera.settings import TesseraSettings

from .dra_claims import DRIVER, ConversionError, MigProfileOffer, Published, convert
from .rules import INVALID_REQUEST, Admitted, Decision, Denial, json_patch

log = logging.getLogger("tessera.admission.dra")

DRA_UNAVAILABLE = "DraUnavailable"


class DraTemplates:
    """`cluster`: the cluster port with `ResourcePort`'s calls (None: DRA cannot be served)."""

    def __init__(self, cluster: Any, settings: TesseraSettings, cache_s: float = 10.0) -> None:
        self.cluster = cluster
        self.settings = settings
        self.cache_s = cache_s
        self._sizes: tuple[float, Published] | None = None

    async def published(self) -> Published:
        """Every card size (MiB) Tessera's driver publishes per mode, and its MIG profiles
        (cached a while)."""
        now = time.monotonic()
        if self._sizes is not None and now - self._sizes[0] < self.cache_s:
            return self._sizes[1]
        sizes: dict[str, set[int]] = {}
        profiles: set[MigProfileOffer] = set()
        for item in await self.cluster.list_resource_slices(driver=DRIVER):
            for device in (item.get("spec") or {}).get("devices") or []:
                attributes = device.get("attributes") or {}
                capacity = device.get("capacity") or {}
                mode = str((attributes.get("mode") or {}).get("string") or "hami-core")
                try:
                    memory = int(parse((capacity.get("memory") or {}).get("value")).value) >> 20
                except QuantityError:
                    continue
                profile = (attributes.get("profile") or {}).get("string")
                if mode == "mig" and isinstance(profile, str):
                    try:
                        cores = int(parse((capacity.get("cores") or {}).get("value")).value)
                    except QuantityError:
                        continue
                    profiles.add(MigProfileOffer(profile, memory, cores))
                elif mode != "mig":
                    sizes.setdefault(mode, set()).add(memory)
        found = Published({m: sorted(v) for m, v in sizes.items()},
                          tuple(sorted(profiles, key=lambda p: (p.memory_mib, p.name))))
        self._sizes = (now, found)
        return found

    async def finish(self, namespace: str, original: dict[str, Any], decision: Admitted,
                     dry_run: bool) -> Decision:  # fmt: skip
        assert decision.dra is not None
        if self.cluster is None:
            return Denial(
                DRA_UNAVAILABLE,
                "this pod is to be placed by DRA, but the webhook has "
                "no cluster API to create its ResourceClaimTemplate",
                500,
            )
        try:
            conversion = convert(decision.dra, self.settings, await self.published())
        except ConversionError as exc:
            return Denial(INVALID_REQUEST, str(exc), 400)
        except ClusterError as exc:
            return Denial(DRA_UNAVAILABLE, f"cannot read the published GPUs: {exc}", 500)
        if not dry_run:
            for template in conversion.templates:
                key = (namespace, template["metadata"]["name"])
                try:
                    await self.cluster.create_resource_claim_template(namespace, template)
                except ConflictError:
                    pass  # made before (by us or another replica): same name, same spec
                except ClusterError as exc:
                    return Denial(DRA_UNAVAILABLE, "cannot create ResourceClaimTemplate "
                                  f"{key[1]} in {namespace}: {exc}", 500)  # fmt: skip
        return dataclasses.replace(
            decision,
            patch=json_patch(original, conversion.pod),
            changes=(*decision.changes, *conversion.changes),
            warnings=(*decision.warnings, *conversion.warnings),
            dra=None,
        )
