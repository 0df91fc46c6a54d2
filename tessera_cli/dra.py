"""`tessera up --dra`: the local stack in DRA mode.

Every simulated node's agent is a kubelet DRA plugin (`TESSERA_DRA=true`, its kubelet's
directories under the stack's socket root, CDI specs in `<node>/cdi`), the webhook converts
HAMi pods into ResourceClaims (`TESSERA_ALLOCATION_MODE=dra`), and Tessera's DeviceClass is
installed once kube-sim answers. A nodes file may put only some nodes in DRA mode (`dra: true`):
one cluster, both modes, on different nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DRIVER = "gpu.tessera.io"
DEVICE_CLASS_PATH = "/apis/resource.k8s.io/v1/deviceclasses"


MIG_CLASS = f"mig.{DRIVER}"
MPS_CLASS = f"mps.{DRIVER}"


def _mode_is(mode: str) -> str:
    return f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].mode == "{mode}"'


def device_class() -> dict[str, Any]:
    """Tessera's DeviceClass: libvgpu slices of the driver's cards in mode hami-core;
    `nvidia.com/gpu` mapped to it (KEP-5004), so a pod the webhook never converted still gets a
    whole card through DRA."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {
            "selectors": [{"cel": {"expression": _mode_is("hami-core")}}],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }


def mig_device_class() -> dict[str, Any]:
    """MIG partitions of cards in dynamic MIG (KEP-4815: one device per profile placement)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": MIG_CLASS},
        "spec": {"selectors": [{"cel": {"expression": _mode_is("mig")}}]},
    }


def mps_device_class() -> dict[str, Any]:
    """Slices of cards in MPS mode, prepared with MPS sharing (the class's opaque config)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": MPS_CLASS},
        "spec": {
            "selectors": [{"cel": {"expression": _mode_is("mps")}}],
            "config": [{"opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS"}}}}],
        },
    }  # fmt: skip


def device_classes() -> list[dict[str, Any]]:
    return [device_class(), mig_device_class(), mps_device_class()]


def node_env(node_dir: Path) -> dict[str, str]:
    """A DRA node agent's settings: kubelet's plugin directories of its simulated kubelet."""
    return {
        "TESSERA_DRA": "true",
        "TESSERA_DRA_KUBELET_DIR": str(node_dir),
        "TESSERA_DRA_CDI_DIR": str(node_dir / "cdi"),
    }


def install_device_class(kubeconfig: Path) -> str:
    """Create the DeviceClasses, and update each one that exists with another spec (an older
    release's: a selector, a mapping or a configuration this release changed), as `kubectl
    apply` would; a line saying what happened."""
    from .kube import KubeClient, load_kubeconfig

    done: dict[str, list[str]] = {"installed": [], "updated": [], "already installed": []}
    with KubeClient(load_kubeconfig(kubeconfig)) as client:
        for cls in device_classes():
            done[apply_device_class(client, cls)].append(cls["metadata"]["name"])
    parts = [f"DeviceClass {', '.join(names)} {what}" for what, names in done.items() if names]
    return "; ".join(parts)


def apply_device_class(client: Any, wanted: dict[str, Any], attempts: int = 5) -> str:
    """Create `wanted`, or replace the spec of the DeviceClass of its name when it differs
    (a PUT at the resourceVersion read: a concurrent writer makes it read again). Returns
    `installed`, `updated` or `already installed`. Labels and annotations others set stay."""
    from .kube import ApiError

    name = wanted["metadata"]["name"]
    for _ in range(attempts):
        try:
            client.post(DEVICE_CLASS_PATH, wanted)
            return "installed"
        except ApiError as error:
            if error.status != 409:
                raise
        try:
            current = client.get(f"{DEVICE_CLASS_PATH}/{name}")
        except ApiError as error:
            if error.status == 404:
                continue  # deleted meanwhile: create it again
            raise
        if current.get("spec") == wanted["spec"]:
            return "already installed"
        replaced = {**current, "spec": wanted["spec"]}
        try:
            client.put(f"{DEVICE_CLASS_PATH}/{name}", replaced)
            return "updated"
        except ApiError as error:
            if error.status not in (404, 409):
                raise  # 409: changed since it was read; 404: deleted: both read again
    raise RuntimeError(f"DeviceClass {name} kept changing while it was applied")


def slice_published(api_url: str, node: str) -> bool:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api_url}/apis/resource.k8s.io/v1/resourceslices/"
                                    f"{node}-{DRIVER}", timeout=2) as reply:  # fmt: skip
            return bool(json.loads(reply.read()).get("spec", {}).get("devices"))
    except (OSError, ValueError):
        return False


def _mib(value: Any) -> int:
    from tessera.quantity import QuantityError, parse

    try:
        return int(parse(value).value) >> 20
    except QuantityError:
        return 0


def _whole(value: Any) -> int:
    from tessera.quantity import QuantityError, parse

    try:
        return int(parse(value).value)
    except QuantityError:
        return 0


def claim_grants(
    client: Any,
    pod: dict[str, Any],
    claims: dict[tuple[str, str], dict[str, Any]] | None = None,
    slices: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """A DRA pod's slices per container (as `pod_gpus` gives an extender pod's) from its
    ResourceClaims' allocations (consumedCapacity) and the driver's ResourceSlice (the GPU's
    UUID and type), and one line per claim for `describe`. `claims` ((namespace, name) →
    claim) and `slices` (pool → slice): already listed (`tessera get`), else each is read."""
    from .locate import CliError

    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    namespace = meta.get("namespace", "default")
    generated = {
        s.get("name"): s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    local = {}
    for entry in spec.get("resourceClaims") or []:
        name = entry.get("resourceClaimName") or generated.get(entry.get("name"))
        if name:
            local[entry.get("name")] = name
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    grants: list[list[dict[str, Any]]] = [[] for _ in containers]
    lines: list[str] = []
    slices = {} if slices is None else slices
    counted: set[str] = set()
    for index, container in enumerate(containers):
        for ref in (container.get("resources") or {}).get("claims") or []:
            claim_name = local.get(ref.get("name"))
            if not claim_name or claim_name in counted:
                continue
            counted.add(claim_name)
            claim = claims.get((namespace, claim_name)) if claims is not None else None
            if claim is None and claims is None:
                try:
                    claim = client.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/"
                                       f"resourceclaims/{claim_name}")  # fmt: skip
                except CliError:
                    claim = None
            if claim is None:
                lines.append(f"{claim_name}: not found")
                continue
            results = (((claim.get("status") or {}).get("allocation") or {}).get("devices")
                       or {}).get("results") or []  # fmt: skip
            if not results:
                lines.append(f"{claim_name}: not allocated yet")
            for result in results:
                if result.get("driver") != DRIVER:
                    lines.append(f"{claim_name}: {result.get('driver')}/{result.get('device')}")
                    continue
                pool = str(result.get("pool", ""))
                if pool not in slices:
                    try:
                        slices[pool] = client.get(f"/apis/resource.k8s.io/v1/resourceslices/"
                                                  f"{pool}-{DRIVER}")  # fmt: skip
                    except CliError:
                        slices[pool] = {}
                device = next((d for d in (slices[pool].get("spec") or {}).get("devices") or []
                               if d.get("name") == result.get("device")), {})  # fmt: skip
                attrs = device.get("attributes") or {}
                capacity = device.get("capacity") or {}
                consumed = result.get("consumedCapacity") or {
                    k: (capacity.get(k) or {}).get("value", "0") for k in ("memory", "cores")}
                grant = {
                    "uuid": (attrs.get("uuid") or {}).get("string", result.get("device")),
                    "type": (attrs.get("type") or {}).get("string", ""),
                    "memory_mib": _mib(consumed.get("memory", "0")),
                    "cores": _whole(consumed.get("cores", "0")),
                }
                grants[index].append(grant)
                share = result.get("shareID")
                lines.append(
                    f"{claim_name}: {pool}/{result.get('device')}"
                    + (f" share {share}" if share else "")
                )
    return grants, lines


def listed_claim_grants(
    client: Any, pods: list[dict[str, Any]], namespace: str | None = None
) -> dict[str, list[list[dict]]]:
    """Pod uid → slices of every DRA pod among `pods` (two list calls, only when one is; the
    claims of `namespace` only when the pods are one namespace's)."""
    from .locate import CliError

    wanted = [p for p in pods if (p.get("spec") or {}).get("resourceClaims")]
    if not wanted:
        return {}
    try:
        claims = {
            (
                (c.get("metadata") or {}).get("namespace", ""),
                (c.get("metadata") or {}).get("name", ""),
            ): c
            for c in client.get(
                f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
                if namespace
                else "/apis/resource.k8s.io/v1/resourceclaims"
            ).get("items")
            or []
        }
        slices: dict[str, dict[str, Any]] = {}
        for sl in client.get("/apis/resource.k8s.io/v1/resourceslices").get("items") or []:
            spec = sl.get("spec") or {}
            if spec.get("driver") != DRIVER:
                continue
            pool = (spec.get("pool") or {}).get("name", "")
            held = slices.setdefault(pool, {"spec": {"devices": []}})  # a pool's slices, merged
            held["spec"]["devices"] += spec.get("devices") or []
    except CliError:
        return {}  # a server without resource.k8s.io: no DRA pods to show
    return {
        str((p.get("metadata") or {}).get("uid", "")): claim_grants(client, p, claims, slices)[0]
        for p in wanted
    }
