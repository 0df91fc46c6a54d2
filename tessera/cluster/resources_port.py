"""The cluster port's Dynamic Resource Allocation calls (`resource.k8s.io/v1`).

What Tessera's DRA parts ask of Kubernetes: the node agent's driver publishes its node's
ResourceSlices and reads the claims kubelet asks it to prepare; the admission webhook reads
the published slices and creates the ResourceClaimTemplates a HAMi pod is converted to; `tessera
up --dra` installs the DeviceClass. Objects are plain JSON, as everywhere in the port.

Implementations: `KubernetesResources` (mixed into the Kubernetes adapter: a real API server or
kube-sim) and `InMemoryResources` (mixed into the in-memory cluster, for unit tests).
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from tessera.cluster.port import (
    ClusterError,
    ConflictError,
    KubeObject,
    NotFoundError,
    WatchEvent,
)

GROUP_VERSION = "resource.k8s.io/v1"
_BASE = f"/apis/{GROUP_VERSION}"


@runtime_checkable
class ResourcePort(Protocol):
    async def get_resource_claim(self, namespace: str, name: str) -> KubeObject:
        """A ResourceClaim with its status (allocation, reservedFor). Raises NotFoundError."""
        ...

    async def list_resource_claims(self, namespace: str | None = None) -> list[KubeObject]: ...

    def watch_resource_claims(self, namespace: str | None = None) -> AsyncIterator[WatchEvent]:
        """List then watch ResourceClaims."""
        ...

    async def list_resource_slices(self, *, driver: str | None = None,
                                   node: str | None = None) -> list[KubeObject]:  # fmt: skip
        """ResourceSlices, optionally of one driver and/or one node (field selectors)."""
        ...

    async def get_resource_slice(self, name: str) -> KubeObject: ...

    async def create_resource_slice(self, resource_slice: KubeObject) -> KubeObject:
        """ConflictError when it exists."""
        ...

    async def replace_resource_slice(self, resource_slice: KubeObject) -> KubeObject:
        """PUT with the resourceVersion it was read at; ConflictError when that is stale."""
        ...

    async def delete_resource_slice(self, name: str) -> None: ...

    async def get_resource_claim_template(self, namespace: str, name: str) -> KubeObject: ...

    async def create_resource_claim_template(self, namespace: str, template: KubeObject
                                             ) -> KubeObject:  # fmt: skip
        """ConflictError when one of that name exists."""
        ...

    async def get_device_class(self, name: str) -> KubeObject: ...

    async def create_device_class(self, device_class: KubeObject) -> KubeObject:
        """ConflictError when it exists."""
        ...


async def list_claims_if_served(cluster: Any) -> list[KubeObject]:
    """Every ResourceClaim of the cluster; [] where the API serves no `resource.k8s.io/v1` (a
    cluster without DRA) or the port has no such call. A 403 says which permission is missing;
    any other failure is raised (the caller tries again)."""
    lister = getattr(cluster, "list_resource_claims", None)
    if lister is None:
        return []
    try:
        claims: list[KubeObject] = await lister()
    except NotFoundError:
        return []
    except ClusterError as exc:
        if exc.status == 403:
            raise ClusterError(
                "ResourceClaims (resource.k8s.io) may not be listed: running DRA pods' slices "
                "cannot be read back; grant `list` on resourceclaims (the chart's ClusterRole "
                "does)", 403) from exc  # fmt: skip
        raise
    return claims


def _quote(segment: str) -> str:
    from urllib.parse import quote

    return quote(segment, safe="")


class KubernetesResources:
    """`ResourcePort` on the Kubernetes adapter's request machinery (rate limit, retries,
    list-then-watch): mixed into `KubernetesCluster`."""

    # Provided by KubernetesCluster.
    _request: Any
    _get_json: Any
    _list_all: Any
    _list_then_watch: Any

    @staticmethod
    def _claims_path(namespace: str | None, name: str | None = None) -> str:
        path = (f"{_BASE}/namespaces/{_quote(namespace)}/resourceclaims" if namespace
                else f"{_BASE}/resourceclaims")  # fmt: skip
        return f"{path}/{_quote(name)}" if name else path

    async def get_resource_claim(self, namespace: str, name: str) -> KubeObject:
        claim: KubeObject = await self._get_json(self._claims_path(namespace, name))
        return claim

    async def list_resource_claims(self, namespace: str | None = None) -> list[KubeObject]:
        items, _ = await self._list_all(self._claims_path(namespace), None, "ResourceClaim")
        return list(items)

    def watch_resource_claims(self, namespace: str | None = None) -> AsyncIterator[WatchEvent]:
        result: AsyncIterator[WatchEvent] = self._list_then_watch(
            self._claims_path(namespace), None, "ResourceClaim"
        )
        return result

    async def list_resource_slices(self, *, driver: str | None = None,
                                   node: str | None = None) -> list[KubeObject]:  # fmt: skip
        selectors = [f"spec.driver={driver}"] if driver else []
        if node:
            selectors.append(f"spec.nodeName={node}")
        items, _ = await self._list_all(
            f"{_BASE}/resourceslices", ",".join(selectors) or None, "ResourceSlice"
        )
        return list(items)

    async def get_resource_slice(self, name: str) -> KubeObject:
        found: KubeObject = await self._get_json(f"{_BASE}/resourceslices/{_quote(name)}")
        return found

    async def create_resource_slice(self, resource_slice: KubeObject) -> KubeObject:
        created: KubeObject = (
            await self._request("POST", f"{_BASE}/resourceslices", body=resource_slice)
        ).payload
        return created

    async def replace_resource_slice(self, resource_slice: KubeObject) -> KubeObject:
        name = resource_slice["metadata"]["name"]
        replaced: KubeObject = (
            await self._request(
                "PUT", f"{_BASE}/resourceslices/{_quote(name)}", body=resource_slice
            )
        ).payload
        return replaced

    async def delete_resource_slice(self, name: str) -> None:
        try:
            await self._request("DELETE", f"{_BASE}/resourceslices/{_quote(name)}")
        except NotFoundError:
            return

    @staticmethod
    def _templates_path(namespace: str, name: str | None = None) -> str:
        path = f"{_BASE}/namespaces/{_quote(namespace)}/resourceclaimtemplates"
        return f"{path}/{_quote(name)}" if name else path

    async def get_resource_claim_template(self, namespace: str, name: str) -> KubeObject:
        found: KubeObject = await self._get_json(self._templates_path(namespace, name))
        return found

    async def create_resource_claim_template(self, namespace: str, template: KubeObject
                                             ) -> KubeObject:  # fmt: skip
        created: KubeObject = (
            await self._request("POST", self._templates_path(namespace), body=template)
        ).payload
        return created

    async def get_device_class(self, name: str) -> KubeObject:
        found: KubeObject = await self._get_json(f"{_BASE}/deviceclasses/{_quote(name)}")
        return found

    async def create_device_class(self, device_class: KubeObject) -> KubeObject:
        created: KubeObject = (
            await self._request("POST", f"{_BASE}/deviceclasses", body=device_class)
        ).payload
        return created


class InMemoryResources:
    """`ResourcePort` for unit tests: objects kept as given, resourceVersions checked on
    replace, watches of claims. Mixed into `InMemoryCluster`; tests put claims with
    `put_resource_claim`."""

    def _dra(self) -> dict[str, dict[Any, KubeObject]]:
        store = self.__dict__.get("_dra_store")
        if store is None:
            store = {"claims": {}, "slices": {}, "templates": {}, "classes": {}}
            self.__dict__["_dra_store"] = store
            self.__dict__["_claim_watchers"] = []
            self.__dict__["_dra_rv"] = 0
        return store

    def _stamp(self, obj: KubeObject) -> KubeObject:
        self._dra()
        self.__dict__["_dra_rv"] += 1
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(self.__dict__["_dra_rv"])
        return obj

    # test helpers
    def put_resource_claim(self, claim: KubeObject) -> KubeObject:
        claim = self._stamp(claim)
        meta = claim["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        kind = "MODIFIED" if key in self._dra()["claims"] else "ADDED"
        self._dra()["claims"][key] = claim
        for queue in self.__dict__["_claim_watchers"]:
            queue.put_nowait(WatchEvent(type=kind, object=copy.deepcopy(claim)))
        return copy.deepcopy(claim)

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        claim = self._dra()["claims"].pop((namespace, name))
        for queue in self.__dict__["_claim_watchers"]:
            queue.put_nowait(WatchEvent(type="DELETED", object=copy.deepcopy(claim)))

    async def get_resource_claim(self, namespace: str, name: str) -> KubeObject:
        try:
            return copy.deepcopy(self._dra()["claims"][(namespace, name)])
        except KeyError:
            raise NotFoundError(f'resourceclaims "{name}" not found', 404) from None

    async def list_resource_claims(self, namespace: str | None = None) -> list[KubeObject]:
        return [copy.deepcopy(c) for (ns, _), c in self._dra()["claims"].items()
                if namespace in (None, ns)]  # fmt: skip

    async def watch_resource_claims(self, namespace: str | None = None
                                    ) -> AsyncIterator[WatchEvent]:  # fmt: skip
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._dra()
        self.__dict__["_claim_watchers"].append(queue)
        try:
            for claim in await self.list_resource_claims(namespace):
                yield WatchEvent(type="ADDED", object=claim)
            while True:
                event = await queue.get()
                if namespace in (None, event.object.get("metadata", {}).get("namespace")):
                    yield event
        finally:
            self.__dict__["_claim_watchers"].remove(queue)

    async def list_resource_slices(self, *, driver: str | None = None,
                                   node: str | None = None) -> list[KubeObject]:  # fmt: skip
        return [copy.deepcopy(s) for s in self._dra()["slices"].values()
                if driver in (None, s["spec"].get("driver"))
                and node in (None, s["spec"].get("nodeName"))]  # fmt: skip

    async def get_resource_slice(self, name: str) -> KubeObject:
        try:
            return copy.deepcopy(self._dra()["slices"][name])
        except KeyError:
            raise NotFoundError(f'resourceslices "{name}" not found', 404) from None

    async def create_resource_slice(self, resource_slice: KubeObject) -> KubeObject:
        name = resource_slice["metadata"]["name"]
        if name in self._dra()["slices"]:
            raise ConflictError(f'resourceslices "{name}" already exists', 409)
        stored = self._stamp(resource_slice)
        self._dra()["slices"][name] = stored
        return copy.deepcopy(stored)

    async def replace_resource_slice(self, resource_slice: KubeObject) -> KubeObject:
        name = resource_slice["metadata"]["name"]
        current = self._dra()["slices"].get(name)
        if current is None:
            raise NotFoundError(f'resourceslices "{name}" not found', 404)
        if (
            resource_slice["metadata"].get("resourceVersion")
            != current["metadata"]["resourceVersion"]
        ):
            raise ConflictError(f'resourceslices "{name}": the object has been modified', 409)
        stored = self._stamp(resource_slice)
        self._dra()["slices"][name] = stored
        return copy.deepcopy(stored)

    async def delete_resource_slice(self, name: str) -> None:
        self._dra()["slices"].pop(name, None)

    async def get_resource_claim_template(self, namespace: str, name: str) -> KubeObject:
        try:
            return copy.deepcopy(self._dra()["templates"][(namespace, name)])
        except KeyError:
            raise NotFoundError(f'resourceclaimtemplates "{name}" not found', 404) from None

    async def create_resource_claim_template(self, namespace: str, template: KubeObject
                                             ) -> KubeObject:  # fmt: skip
        key = (namespace, template["metadata"]["name"])
        if key in self._dra()["templates"]:
            raise ConflictError(f'resourceclaimtemplates "{key[1]}" already exists', 409)
        stored = self._stamp(template)
        stored["metadata"]["namespace"] = namespace
        self._dra()["templates"][key] = stored
        return copy.deepcopy(stored)

    async def get_device_class(self, name: str) -> KubeObject:
        try:
            return copy.deepcopy(self._dra()["classes"][name])
        except KeyError:
            raise NotFoundError(f'deviceclasses "{name}" not found', 404) from None

    async def create_device_class(self, device_class: KubeObject) -> KubeObject:
        name = device_class["metadata"]["name"]
        if name in self._dra()["classes"]:
            raise ConflictError(f'deviceclasses "{name}" already exists', 409)
        stored = self._stamp(device_class)
        self._dra()["classes"][name] = stored
        return copy.deepcopy(stored)
