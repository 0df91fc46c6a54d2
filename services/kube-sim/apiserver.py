"""kube-sim's API server: the subset of the Kubernetes REST API Tessera's services use.

Paths, verbs, content types and JSON shapes are kube-apiserver's, so services reach it through
the same Kubernetes adapter (`tessera.cluster.kubernetes_api`) they use in a real cluster:
pods (create through admission, get, list, watch, delete, merge/JSON patch, binding, status),
resourcequotas, nodes and events. Errors are `metav1.Status` objects.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import jsonpatch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tessera.kube_sim.store import (
    KubeObject,
    ObjectStore,
    Selector,
    StoreError,
    conflict,
    gone,
    now_rfc3339,
)

log = logging.getLogger("tessera.kube_sim.api")

MAX_BODY_BYTES = 3 * 1024 * 1024  # kube-apiserver's request size limit
BOOKMARK_INTERVAL_S = 5.0
EVENTS_KEPT = 5000

# Called on every pod CREATE before it is stored: returns the (mutated) pod or raises StoreError.
AdmitPod = Callable[[KubeObject, str], Awaitable[KubeObject]]

RESOURCES = {"pods": "Pod", "resourcequotas": "ResourceQuota", "nodes": "Node", "events": "Event"}
CLUSTER_SCOPED = {"Node"}
IMMUTABLE_META = ("name", "namespace", "uid", "creationTimestamp", "generateName")


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }


def error_response(error: StoreError) -> JSONResponse:
    return JSONResponse(status_body(error.status, error.reason, error.message), error.status)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, null deletes, the rest replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def parse_field_selector(text: str | None) -> str | None:
    """The node name from `spec.nodeName=X` (the only field selector Tessera uses)."""
    if not text:
        return None
    node: str | None = None
    for term in text.split(","):
        name, sep, value = term.partition("=")
        name = name.rstrip("=")
        value = value.lstrip("=")
        if not sep or name.strip() not in ("spec.nodeName",):
            raise StoreError(400, "BadRequest", f'field label not supported: "{term}"')
        node = value.strip()
    return node


def parse_label_selector(text: str | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for term in (text or "").split(","):
        if not term.strip():
            continue
        name, sep, value = term.partition("=")
        if not sep:
            raise StoreError(400, "BadRequest", f'unable to parse requirement: "{term}"')
        labels[name.strip()] = value.lstrip("=").strip()
    return labels


def encode_continue(version: str, after: tuple[str, str]) -> str:
    raw = json.dumps({"rv": version, "after": list(after)}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_continue(token: str) -> tuple[str, tuple[str, str]]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return str(data["rv"]), (str(data["after"][0]), str(data["after"][1]))
    except (ValueError, KeyError, IndexError, TypeError, binascii.Error) as exc:
        raise StoreError(400, "BadRequest", "invalid continue token") from exc


class ApiServer:
    """The HTTP face of an `ObjectStore`; `admit_pod` is the admission chain for pod creates."""

    def __init__(
        self,
        store: ObjectStore,
        admit_pod: AdmitPod | None = None,
        bookmark_interval_s: float = BOOKMARK_INTERVAL_S,
    ) -> None:
        self.store = store
        self.admit_pod = admit_pod
        self.bookmark_interval_s = bookmark_interval_s
        self.on_pod_deleted: list[Callable[[KubeObject], None]] = []
        # Added by other modules (disruption.py): routes served before the core ones, and
        # built-in admission steps run on every pod CREATE before the webhook (Priority).
        self.extra_routes: list[Route] = []
        self.pod_admitters: list[Callable[[KubeObject], KubeObject]] = []
        # node name -> its kubelet (anything with describe()), for the debug endpoint
        self.kubelets: dict[str, Any] = {}

    def app(self) -> Starlette:
        ns = "/api/v1/namespaces/{namespace}"
        routes = [
            *self.extra_routes,
            Route("/healthz", self.healthz),
            Route("/readyz", self.healthz),
            Route("/livez", self.healthz),
            Route("/version", self.version),
            Route("/api", self.api_versions),
            Route("/kube-sim/v1/nodes/{name}/containers", self.node_containers),
            Route("/api/v1/{resource}", self.collection, methods=["GET", "POST"]),
            Route(f"{ns}/{{resource}}", self.collection, methods=["GET", "POST"]),
            Route("/api/v1/nodes/{name}", self.item, methods=["GET", "PUT", "PATCH", "DELETE"]),
            Route(
                f"{ns}/{{resource}}/{{name}}", self.item, methods=["GET", "PUT", "PATCH", "DELETE"]
            ),
            Route(f"{ns}/pods/{{name}}/binding", self.binding, methods=["POST"]),
            Route(
                f"{ns}/{{resource}}/{{name}}/status", self.status, methods=["GET", "PUT", "PATCH"]
            ),
        ]
        return Starlette(routes=routes)

    # --- small endpoints ----------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return Response("ok", media_type="text/plain")

    async def version(self, request: Request) -> Response:
        return JSONResponse(
            {"major": "1", "minor": "31", "gitVersion": "v1.31.0-kube-sim", "platform": "linux"}
        )

    async def api_versions(self, request: Request) -> Response:
        return JSONResponse({"kind": "APIVersions", "versions": ["v1"]})

    async def node_containers(self, request: Request) -> Response:
        """Not a Kubernetes API: what the node's kubelet gave each container (env, mounts)."""
        kubelet = self.kubelets.get(request.path_params["name"])
        if kubelet is None:
            return error_response(StoreError(404, "NotFound", "no kubelet for that node"))
        return JSONResponse(kubelet.describe())

    # --- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _kind(request: Request) -> str:
        resource = request.path_params.get("resource", "nodes")
        kind = RESOURCES.get(resource)
        if kind is None:
            raise StoreError(
                404, "NotFound", f"the server could not find the requested resource ({resource})"
            )
        return kind

    @staticmethod
    async def _body(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise StoreError(413, "RequestEntityTooLarge", "request entity too large")
        try:
            return json.loads(raw) if raw else None
        except ValueError as exc:
            raise StoreError(400, "BadRequest", f"invalid JSON body: {exc}") from exc

    # --- collections ----------------------------------------------------------------------------

    async def collection(self, request: Request) -> Response:
        try:
            kind = self._kind(request)
            namespace = request.path_params.get("namespace")
            if kind in CLUSTER_SCOPED and namespace:
                raise StoreError(404, "NotFound", "cluster-scoped resource")
            if request.method == "POST":
                return await self._create(request, kind, namespace or "")
            query = request.query_params
            selector = Selector(
                namespace=namespace,
                node_name=parse_field_selector(query.get("fieldSelector")),
                labels=parse_label_selector(query.get("labelSelector")),
            )
            if query.get("watch") in ("true", "1"):
                return self._watch(request, kind, selector)
            return self._list(kind, selector, query.get("limit"), query.get("continue"))
        except StoreError as error:
            return error_response(error)

    def _list(
        self, kind: str, selector: Selector, limit: str | None, token: str | None
    ) -> Response:
        items = self.store.list(kind, selector)
        version = str(self.store.version)
        if token:
            version, after = decode_continue(token)
            items = [
                i
                for i in items
                if (i["metadata"].get("namespace", ""), i["metadata"]["name"]) > after
            ]
        meta: dict[str, Any] = {"resourceVersion": version}
        if limit and limit.isdigit() and int(limit) > 0 and len(items) > int(limit):
            items = items[: int(limit)]
            last = items[-1]["metadata"]
            meta["continue"] = encode_continue(version, (last.get("namespace", ""), last["name"]))
            meta["remainingItemCount"] = 0
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return JSONResponse(
            {"kind": f"{kind}List", "apiVersion": "v1", "metadata": meta, "items": items}
        )

    async def _create(self, request: Request, kind: str, namespace: str) -> Response:
        obj = await self._body(request)
        if not isinstance(obj, dict):
            raise StoreError(400, "BadRequest", "the body must be a JSON object")
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise StoreError(400, "BadRequest", "metadata must be an object")
        if kind not in CLUSTER_SCOPED:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise StoreError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the "
                    "namespace sent on the request",
                )
            meta["namespace"] = namespace or "default"
        for field in ("uid", "resourceVersion"):
            meta.pop(field, None)
        if kind == "Pod":
            obj = self._pod_defaults(obj)
            for admit in self.pod_admitters:
                obj = admit(obj)
            if self.admit_pod is not None:
                obj = await self.admit_pod(obj, "CREATE")
        created = self.store.create(kind, obj)
        if kind == "Event":
            self.store.trim("Event", EVENTS_KEPT)
        return JSONResponse(created, 201)

    @staticmethod
    def _pod_defaults(pod: KubeObject) -> KubeObject:
        spec = pod.setdefault("spec", {})
        if not isinstance(spec, dict) or not isinstance(spec.get("containers"), list):
            raise StoreError(422, "Invalid", "spec.containers: Required value")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("restartPolicy", "Always")
        pod["metadata"].setdefault("labels", {})
        pod["metadata"].setdefault("annotations", {})
        pod["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        return pod

    def _watch(self, request: Request, kind: str, selector: Selector) -> Response:
        query = request.query_params
        raw_version = query.get("resourceVersion") or ""
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        initial: list[KubeObject] = []
        error: StoreError | None = None
        watcher = None
        if raw_version in ("", "0"):
            # "Most recent": the current objects as ADDED, then every change after.
            initial = self.store.list(kind, selector)
            watcher = self.store.watch(kind, selector, self.store.version)
        else:
            try:
                since = int(raw_version)
                if since > self.store.version:
                    raise gone(since)  # from another incarnation of the server: relist
                watcher = self.store.watch(kind, selector, since)
            except ValueError:
                error = StoreError(400, "BadRequest", f"invalid resourceVersion {raw_version!r}")
            except StoreError as exc:
                error = exc
        store = self.store
        interval = self.bookmark_interval_s

        def line(event_type: str, obj: KubeObject) -> bytes:
            return json.dumps({"type": event_type, "object": obj}).encode() + b"\n"

        async def events() -> AsyncIterator[bytes]:
            if error is not None:
                # As kube-apiserver's watch cache does: a 200 stream with one ERROR event.
                yield line("ERROR", status_body(error.status, error.reason, error.message))
                return
            assert watcher is not None
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            try:
                for obj in initial:
                    yield line("ADDED", obj)
                while True:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return
                    try:
                        event_type, obj = await asyncio.wait_for(
                            watcher.queue.get(), min(remaining, interval)
                        )
                    except TimeoutError:
                        if bookmarks and watcher.queue.empty():
                            mark = {
                                "kind": kind,
                                "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(store.version)},
                            }
                            yield line("BOOKMARK", mark)
                        continue
                    yield line(event_type, obj)
            finally:
                store.unwatch(watcher)

        return StreamingResponse(events(), media_type="application/json")

    # --- single objects -------------------------------------------------------------------------

    async def item(self, request: Request) -> Response:
        try:
            kind = self._kind(request)
            namespace = request.path_params.get("namespace", "")
            name = request.path_params["name"]
            if request.method == "GET":
                return JSONResponse(self.store.get(kind, namespace, name))
            if request.method == "DELETE":
                body = await self._body(request)
                uid = None
                if isinstance(body, dict):
                    uid = (body.get("preconditions") or {}).get("uid")
                deleted = self.store.delete(kind, namespace, name, uid)
                if kind == "Pod":
                    for callback in self.on_pod_deleted:
                        callback(deleted)
                return JSONResponse(deleted)
            if request.method == "PUT":
                return await self._replace(request, kind, namespace, name)
            return await self._patch(request, kind, namespace, name, status_only=False)
        except StoreError as error:
            return error_response(error)

    async def status(self, request: Request) -> Response:
        try:
            kind = self._kind(request)
            namespace = request.path_params.get("namespace", "")
            name = request.path_params["name"]
            if request.method == "GET":
                return JSONResponse(self.store.get(kind, namespace, name))
            if request.method == "PUT":
                body = await self._body(request)
                if not isinstance(body, dict):
                    raise StoreError(400, "BadRequest", "the body must be a JSON object")
                new_status = body.get("status") or {}

                def set_status(obj: KubeObject) -> None:
                    obj["status"] = new_status

                return JSONResponse(self.store.mutate(kind, namespace, name, set_status))
            return await self._patch(request, kind, namespace, name, status_only=True)
        except StoreError as error:
            return error_response(error)

    async def _replace(self, request: Request, kind: str, namespace: str, name: str) -> Response:
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise StoreError(400, "BadRequest", "the body must be an object with metadata")
        body["metadata"]["name"] = name
        if kind not in CLUSTER_SCOPED:
            body["metadata"]["namespace"] = namespace
        expected = body["metadata"].get("resourceVersion")
        return JSONResponse(self.store.replace(kind, body, str(expected) if expected else None))

    async def _patch(
        self, request: Request, kind: str, namespace: str, name: str, status_only: bool
    ) -> Response:
        patch = await self._body(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip()

        def apply(obj: KubeObject) -> None:
            before = {k: obj["metadata"].get(k) for k in IMMUTABLE_META}
            version = obj["metadata"].get("resourceVersion")
            if content_type == "application/json-patch+json":
                try:
                    patched = jsonpatch.apply_patch(obj, patch)
                except (
                    jsonpatch.JsonPatchException,
                    jsonpatch.JsonPointerException,
                    TypeError,
                ) as exc:
                    raise StoreError(422, "Invalid", f"the JSON patch failed: {exc}") from exc
            elif content_type in (
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
            ):
                if not isinstance(patch, dict):
                    raise StoreError(400, "BadRequest", "a merge patch must be a JSON object")
                wanted = (patch.get("metadata") or {}).get("resourceVersion")
                if wanted and str(wanted) != version:
                    raise conflict(f'the object "{name}" has been modified; please retry')
                patched = merge_patch(obj, patch)
            else:
                raise StoreError(
                    415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"
                )
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata"), dict):
                raise StoreError(422, "Invalid", "the patch removed metadata")
            if status_only:
                patched = {**obj, "status": patched.get("status", {})}
            for key, value in before.items():
                if value is None:
                    patched["metadata"].pop(key, None)
                else:
                    patched["metadata"][key] = value
            obj.clear()
            obj.update(patched)

        return JSONResponse(self.store.mutate(kind, namespace, name, apply))

    async def binding(self, request: Request) -> Response:
        try:
            namespace = request.path_params["namespace"]
            name = request.path_params["name"]
            body = await self._body(request)
            if not isinstance(body, dict):
                raise StoreError(400, "BadRequest", "the body must be a Binding")
            target = (body.get("target") or {}).get("name")
            if not target:
                raise StoreError(422, "Invalid", "target.name: Required value")
            uid = (body.get("metadata") or {}).get("uid")
            self.bind(namespace, name, str(target), uid)
            return JSONResponse(status_body(201, "", "") | {"status": "Success"}, 201)
        except StoreError as error:
            return error_response(error)

    def bind(self, namespace: str, name: str, node: str, uid: str | None = None) -> KubeObject:
        """Assign the pod to a node once; a second binding is a conflict, as in kube-apiserver."""
        self.store.get("Node", "", node)  # 404 for a node that does not exist

        def assign(pod: KubeObject) -> None:
            if uid and pod["metadata"].get("uid") != uid:
                raise conflict(
                    f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                    f"{pod['metadata'].get('uid')}"
                )
            current = pod.get("spec", {}).get("nodeName")
            if current:
                raise conflict(f'pod {name} is already assigned to node "{current}"')
            pod["spec"]["nodeName"] = node
            conditions = [
                c
                for c in pod.setdefault("status", {}).get("conditions", [])
                if c.get("type") != "PodScheduled"
            ]
            conditions.append(
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()}
            )
            pod["status"]["conditions"] = conditions

        return self.store.mutate("Pod", namespace, name, assign)
