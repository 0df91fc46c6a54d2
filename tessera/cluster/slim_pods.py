"""A pod listing that holds only what placement bookkeeping reads of a pod.

The scheduler's rebuild before it serves (and HAMi's classification of the same listing) reads a
handful of a pod's fields: its identity, node, scheduler and phase, its containers' names,
resources and restart policy, its init containers' exit codes and HAMi's placement annotations.
At 5,000 nodes that listing is ~80,000 pods, and a plain JSON decode builds every object of
every pod (managedFields, env, volumes, statuses) before any of it is read, then frees them all.

Here a page's uids and scheduler names are read first, in C (`_Skim`: nothing else of a pod is
built). A caller's `need` (given them for a whole page at once) then leaves out the pods it does
not read (the rebuild: those the synced ledger already places, not HAMi's), never decoded; only
when it wants some is the page read again for where each pod's text lies (`msgspec.Raw`), and
those pods decoded against `SlimPod`, which skips every other field without building it.

What comes out is the API server's objects with the other keys left out: plain dicts of the
same shapes, so every reader of a pod dict reads them unchanged, and any key it reads is there
when the server sent it. JSON the schemas do not fit (a value of the wrong kind where they expect
an object or a list; text msgspec refuses but the standard library takes) is decoded in full
instead — the page when its uids or scheduler names cannot be read, else the one pod — exactly
as a plain listing decodes it: never refused here, never read differently.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress
from typing import Any, NamedTuple, TypedDict

import msgspec

from tessera import hami
from tessera.cluster.port import KubeObject
from tessera.device_kinds import pod_grants
from tessera.signing import RECORD_ANNOTATION


class _Terminated(TypedDict, total=False):
    exitCode: Any


class _ContainerState(TypedDict, total=False):
    terminated: _Terminated


class _ContainerStatus(TypedDict, total=False):
    state: _ContainerState


class _Status(TypedDict, total=False):
    phase: Any
    initContainerStatuses: list[_ContainerStatus]
    resourceClaimStatuses: Any  # a DRA pod's generated claims (tessera.dra_restore)


class _Container(TypedDict, total=False):
    name: Any
    resources: Any  # the GPU resource names are settings: kept whole (a few keys)
    restartPolicy: Any


class _Spec(TypedDict, total=False):
    nodeName: Any
    schedulerName: Any
    containers: list[_Container]
    initContainers: list[_Container]
    resourceClaims: Any  # a DRA pod's claims (tessera.dra_restore)


# HAMi's placement record (tessera.restore and the scheduler's foreign.py read these only):
# every device family's grant keys (NVIDIA's hami.io/vgpu-devices-… among them).
ANNOTATIONS = (*dict.fromkeys((hami.ANN_DEVICES_ALLOCATED, hami.ANN_DEVICES_TO_ALLOCATE,
                               *pod_grants.all_keys())),
               hami.ANN_VGPU_NODE, hami.ANN_BIND_PHASE, RECORD_ANNOTATION)  # fmt: skip
_Annotations = TypedDict("_Annotations", dict.fromkeys(ANNOTATIONS, Any), total=False)  # type: ignore[misc]


class _Metadata(TypedDict, total=False):
    uid: Any
    name: Any
    namespace: Any
    resourceVersion: Any
    annotations: _Annotations


class SlimPod(TypedDict, total=False):
    """The fields kept (TypedDict: decoded as a plain dict, keys absent when the pod has none)."""

    metadata: _Metadata
    spec: _Spec
    status: _Status


_ListMeta = TypedDict("_ListMeta", {"continue": Any, "resourceVersion": Any}, total=False)


class _SkimMeta(msgspec.Struct):
    uid: Any = None


class _SkimSpec(msgspec.Struct):
    schedulerName: Any = None


class _Skim(msgspec.Struct):
    """What a caller may skip a pod by, read before the pod itself."""

    metadata: _SkimMeta | None = None
    spec: _SkimSpec | None = None


class _SkimPage(msgspec.Struct):
    items: list[_Skim] = []
    metadata: _ListMeta = {}


class _RawPage(msgspec.Struct):
    items: list[msgspec.Raw] = []


_SKIM_PAGE = msgspec.json.Decoder(_SkimPage)
_RAW_PAGE = msgspec.json.Decoder(_RawPage)
_SKIMS = msgspec.json.Decoder(list[_Skim])
_RAWS = msgspec.json.Decoder(list[msgspec.Raw])
_POD = msgspec.json.Decoder(SlimPod)

# (the uids, the scheduler names) of a page's pods, None where absent -> for each pod whether
# the caller reads it; the others are counted and never decoded. Asked once a page.
Need = Callable[[list[Any], list[Any]], list[bool]]


def key_of(pod: Any) -> tuple[Any, Any]:
    """A decoded pod's (uid, scheduler name), as `_Skim` reads them off the JSON."""
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    spec = pod.get("spec") if isinstance(pod, dict) else None
    return (meta.get("uid") if isinstance(meta, dict) else None,
            spec.get("schedulerName") if isinstance(spec, dict) else None)  # fmt: skip


@dataclass
class PodPage:
    """One page's pods: their uids and scheduler names read, the pods themselves decoded only as
    `read` asks (from `text`, the page's JSON; or `pods`, decoded already in full)."""

    uids: list[Any]
    schedulers: list[Any]
    text: bytes | None = None
    array: bool = False  # `text` is a JSON array of pods (else a PodList)
    pods: list[Any] | None = None

    @classmethod
    def of(cls, pods: Any) -> PodPage:
        """Pods already decoded (a page the schemas did not fit, an in-memory cluster's)."""
        pods = list(pods)
        keys = [key_of(pod) for pod in pods]
        return cls([k[0] for k in keys], [k[1] for k in keys], pods=pods)

    @classmethod
    def skimmed(cls, skims: list[_Skim], text: bytes, *, array: bool) -> PodPage:
        return cls([k.metadata.uid if k.metadata is not None else None for k in skims],
                   [k.spec.schedulerName if k.spec is not None else None for k in skims],
                   text, array)  # fmt: skip

    def __len__(self) -> int:
        return len(self.uids)

    def read(self, wanted: list[bool] | None = None) -> list[KubeObject]:
        """The pods `wanted` marks (all with None), slim; a pod the schema does not fit: in
        full."""
        if self.pods is not None:
            return self.pods if wanted is None else list(compress(self.pods, wanted))
        if self.text is None or (wanted is not None and not any(wanted)):
            return []
        raws = _RAWS.decode(self.text) if self.array else _RAW_PAGE.decode(self.text).items
        return [_decoded(raw) for raw in (raws if wanted is None else compress(raws, wanted))]


def _decoded(raw: msgspec.Raw) -> Any:
    try:
        return _POD.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return json.loads(bytes(raw))


def decode_pod_page(data: bytes) -> Any:
    """A PodList page as the API server sends it: its metadata, and its items as a `PodPage`.
    A page the schemas do not fit is decoded in full, as a plain listing decodes it."""
    try:
        skim = _SKIM_PAGE.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        page = json.loads(data)
        if isinstance(page, dict):
            page["items"] = PodPage.of(page.get("items") or [])
        return page
    return {"metadata": skim.metadata, "items": PodPage.skimmed(skim.items, data, array=False)}


def decode_pods(data: bytes) -> PodPage:
    """A JSON array of pods (a file, a stand-in's answer), as `decode_pod_page`'s items."""
    try:
        return PodPage.skimmed(_SKIMS.decode(data), data, array=True)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return PodPage.of(json.loads(data))


class Listed(NamedTuple):
    pods: list[KubeObject]  # slim, in the listing's order
    skipped: int  # pods `need` left out, never decoded


class SlimReader:
    """Takes a listing page by page: the pods `need` says the caller does not read are counted
    and dropped undecoded; the others are decoded slim. Pages are taken as they come, so at most
    one page's text is held at once."""

    def __init__(self, need: Need | None = None) -> None:
        self.need = need
        self.skipped = 0

    def take(self, items: Any) -> list[KubeObject]:
        page = items if isinstance(items, PodPage) else PodPage.of(items or [])
        if self.need is None:
            return page.read()
        wanted = self.need(page.uids, page.schedulers)
        self.skipped += len(page) - sum(wanted)
        return page.read(wanted)


async def list_pods_slim(cluster: Any, need: Need | None = None) -> Listed:
    """The cluster's slim listing; from a stand-in without one, its full listing (a superset of
    every slim pod), `need` applied alike."""
    lister = getattr(cluster, "list_pods_slim", None)
    if lister is not None:
        listed: Listed = await lister(need)
        return listed
    reader = SlimReader(need)
    return Listed(reader.take(await cluster.list_pods()), reader.skipped)


# What `SlimPod` keeps, as nested dicts ([schema]: a list of such objects; None: the value whole).
_KEEP: dict[str, Any] = {
    "metadata": {"uid": None, "name": None, "namespace": None, "resourceVersion": None,
                 "annotations": dict.fromkeys(ANNOTATIONS)},
    "spec": {"nodeName": None, "schedulerName": None,
             "containers": [{"name": None, "resources": None, "restartPolicy": None}],
             "initContainers": [{"name": None, "resources": None, "restartPolicy": None}],
             "resourceClaims": None},
    "status": {"phase": None,
               "initContainerStatuses": [{"state": {"terminated": {"exitCode": None}}}],
               "resourceClaimStatuses": None},
}  # fmt: skip


def slim(pod: Any) -> Any:
    """A pod already decoded (an in-memory cluster's), cut to the slim fields as the real client's
    listing cuts it. Values are kept as they are; where the pod's shape is not the schema's
    (not an object, not a list) the value is kept whole, as a page the schema does not fit is."""
    return _cut(pod, _KEEP)


def _cut(value: Any, keep: Any) -> Any:
    if keep is None:
        return value
    if isinstance(keep, list):
        return [_cut(v, keep[0]) for v in value] if isinstance(value, list) else value
    if not isinstance(value, dict):
        return value
    return {k: _cut(v, keep[k]) for k, v in value.items() if k in keep}
