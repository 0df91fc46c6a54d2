"""kube-sim's API server: the subset of the Kubernetes REST API Tessera's services use.

Paths, verbs, content types and JSON shapes are kube-apiserver's, so services reach it through
the same Kubernetes adapter (`tessera.cluster.kubernetes_api`) they use in a real cluster, and
`kubectl` works against it: pods (create through admission, get, list, watch, delete,
merge/strategic/JSON patch, binding, status), resourcequotas, nodes, events, namespaces and the
workload kinds (apps/v1 Deployments and ReplicaSets with `scale`, batch/v1 Jobs); discovery and a
minimal OpenAPI v3 (`discovery.py`), Table output for `kubectl get` (`tables.py`), defaulting
and validation (`validation.py`). Errors are `metav1.Status` objects worded as kube-apiserver's.
Also configmaps (per-node device configuration), secrets and the admissionregistration webhook
configurations (a webhook that provisions its own certificate).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import jsonpatch
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tessera.kube_sim import (
    bodies,
    discovery,
    protobuf,
    schema,
    strategic_merge,
    tables,
    validation,
)
from tessera.kube_sim.dra import objects as dra_objects
from tessera.kube_sim.dra import printers as _dra_printers  # noqa: F401  (Table columns)
from tessera.kube_sim.dra import quota as dra_quota
from tessera.kube_sim.dra import schemas as _dra_schemas  # noqa: F401  (strict decoding)
from tessera.kube_sim.identity import Authentication, TokenTable
from tessera.kube_sim.objects import (
    WORKLOADS,
    job_selector,
    namespace_object,
    qos_class,
    quota_status,
    scale_of,
    validate_update,
)
from tessera.kube_sim.response_warnings import WarningHeaders, add_warning
from tessera.kube_sim.selectors import SelectorError, parse_fields, parse_labels
from tessera.kube_sim.store import (
    KubeObject,
    ObjectStore,
    Selector,
    StoreError,
    conflict,
    decoded,
    gone,
    now_rfc3339,
)
from tessera.kube_sim.updates import AdmitUpdate, admitted_change, status_update
from tessera.kube_sim.watch_lines import EncodedEvents

from tessera.quantity import JsonNumber

log = logging.getLogger("tessera.kube_sim.api")

MAX_BODY_BYTES = 3 * 1024 * 1024  # kube-apiserver's request size limit
# Bodies read as JSON ("" too: kube-sim is lenient with a client that names none); YAML and
# protobuf are read as well; anything else (CBOR, text) is 415 with kube-apiserver's message.
JSON_BODIES = frozenset({"", "application/json", "application/merge-patch+json",
                         "application/strategic-merge-patch+json",
                         "application/json-patch+json"})
UNKNOWN_FORMAT = ("the body of the request was in an unknown format - accepted media types "
                  "include: application/json, application/yaml, "
                  "application/vnd.kubernetes.protobuf")
BOOKMARK_INTERVAL_S = 5.0
EVENTS_KEPT = 5000

# Called on every pod CREATE before it is stored: returns the (mutated) pod or raises StoreError.
# Pod UPDATEs (and pods/status) go through `updates.AdmitUpdate`.
AdmitPod = Callable[[KubeObject, str], Awaitable[KubeObject]]

RESOURCES = {"pods": "Pod", "resourcequotas": "ResourceQuota", "nodes": "Node", "events": "Event"}
CLUSTER_SCOPED = {"Node"}
# kinds added with the kubectl work (one home for their description: discovery.TYPES)
RESOURCES.update(
    {"namespaces": "Namespace", "deployments": "Deployment", "replicasets": "ReplicaSet",
     "jobs": "Job"}
)
CLUSTER_SCOPED.add("Namespace")
# configmaps (per-node device configuration), secrets and the webhook configurations (a webhook
# that provisions its own certificate writes its caBundle there)
RESOURCES.update(
    {"configmaps": "ConfigMap", "secrets": "Secret", "limitranges": "LimitRange",
     "mutatingwebhookconfigurations": "MutatingWebhookConfiguration",
     "validatingwebhookconfigurations": "ValidatingWebhookConfiguration"}
)
CLUSTER_SCOPED.update({"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"})
# The field selectors kube-apiserver supports per kind (metadata.name/namespace for all).
FIELD_LABELS = {
    "Pod": {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
            "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP",
            "status.nominatedNodeName"},
    "Event": {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
              "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
              "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"},
    "Node": {"spec.unschedulable"},
    "Namespace": {"status.phase"},
    "Job": {"status.successful"},
}
# Dynamic Resource Allocation (dra/objects.py): the four resource.k8s.io/v1 kinds
RESOURCES.update(dra_objects.RESOURCES)
CLUSTER_SCOPED.update(dra_objects.CLUSTER_SCOPED)
FIELD_LABELS.update(dra_objects.FIELD_LABELS)
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
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


_INT64 = re.compile(r"-?[0-9]{1,19}")


def int64_param(name: str, text: str | None) -> int | None:
    """A numeric query parameter as kube-apiserver decodes it (int64; absent: None); anything
    else a 400 (`str.isdigit` would take '²', which int() refuses)."""
    if text is None or text == "":
        return None
    if not _INT64.fullmatch(text) or not -(2**63) <= int(text) < 2**63:
        raise StoreError(400, "BadRequest", f"invalid {name}: {text[:40]!r} is not an integer")
    return int(text)


def error_response(error: StoreError) -> JSONResponse:
    body = status_body(error.status, error.reason, error.message)
    if error.details:
        body["details"] = error.details
    return JSONResponse(body, error.status)


def field_warnings(request: Request, kind: str, body: Any) -> list[str]:
    """kube-apiserver's field validation of a write: `Strict` refuses unknown fields (400
    BadRequest, strict decoding error), `Warn` (the default) and `Ignore` store them, `Warn`
    with a warning per field."""
    mode = request.query_params.get("fieldValidation") or "Warn"
    if mode not in ("Strict", "Warn", "Ignore"):
        raise StoreError(400, "BadRequest", f"fieldValidation parameter unsupported: {mode!r}; "
                         "supported values: Ignore, Strict, Warn")
    if mode == "Ignore":
        return []
    problems = schema.field_problems(kind, body, getattr(request.state, "duplicates", []))
    if problems and mode == "Strict":
        raise StoreError(400, "BadRequest", schema.strict_error_message(
            kind, discovery.api_version_of(kind) or "v1", problems))
    return problems


def with_warnings(response: Response, warnings: list[str]) -> Response:
    """RFC 7234 Warning headers (code 299), which kubectl prints as `Warning: ...` (added to
    the request's recorder: `response_warnings`)."""
    for warning in warnings:
        add_warning(warning)
    return response


def _dry_run(request: Request) -> bool:
    """`dryRun=All`: validated, admitted and answered as if written, and not written."""
    return request.query_params.get("dryRun") == "All"


def no_such_resource() -> StoreError:
    return StoreError(404, "NotFound", "the server could not find the requested resource")


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
        admit_update: AdmitUpdate | None = None,
        tokens: TokenTable | None = None,
    ) -> None:
        self.store = store
        self.admit_pod = admit_pod
        self.admit_update = admit_update
        # who each bearer token is (identity.py); without a table, the legacy token is admin
        self.tokens = tokens or TokenTable.legacy()
        self.bookmark_interval_s = bookmark_interval_s
        self.encoded_events = EncodedEvents()  # watch lines encoded once for every stream
        self.on_pod_deleted: list[Callable[[KubeObject], None]] = []
        # Added by other modules (disruption.py): routes served before the core ones, and
        # built-in admission steps run on every pod CREATE before the webhook (Priority).
        self.extra_routes: list[Route] = []
        self.pod_admitters: list[Callable[[KubeObject], KubeObject]] = []
        # The validating webhook of DRA objects (dra/validating_webhook.py), after validation:
        # (kind, object, operation, the stored object on UPDATE)
        self.validate_dra: (
            Callable[[str, KubeObject, str, KubeObject | None], Awaitable[None]] | None) = None
        # node name -> its kubelet (anything with describe()), for the debug endpoint
        self.kubelets: dict[str, Any] = {}
        self.now: Callable[[], datetime] = lambda: datetime.now(UTC)
        for namespace in INITIAL_NAMESPACES:
            self.ensure_namespace(namespace)

    def app(self) -> Starlette:
        ns = "/api/v1/namespaces/{namespace}"
        routes = [
            *self.extra_routes,
            Route("/healthz", self.healthz),
            Route("/readyz", self.healthz),
            Route("/livez", self.healthz),
            Route("/version", self.version),
            Route("/api", self.api_versions),
            Route("/api/v1", self.core_resources),
            Route("/apis", self.api_groups),
            Route("/apis/{group}", self.api_group),
            Route("/apis/{group}/{version}", self.group_resources),
            Route("/openapi/v3", self.openapi_root),
            Route("/openapi/v3/{path:path}", self.openapi_document),
            Route("/kube-sim/v1/nodes/{name}/containers", self.node_containers),
            Route("/api/v1/{resource}", self.collection, methods=["GET", "POST"]),
            Route(f"{ns}/{{resource}}", self.collection, methods=["GET", "POST"]),
            Route("/api/v1/nodes/{name}", self.item, methods=["GET", "PUT", "PATCH", "DELETE"]),
            Route(
                f"{ns}/{{resource}}/{{name}}", self.item, methods=["GET", "PUT", "PATCH", "DELETE"]
            ),
            Route(f"{ns}/pods/{{name}}/binding", self.binding, methods=["POST"]),
            Route(f"{ns}/pods/{{name}}/log", self.pod_log),
            Route(
                f"{ns}/{{resource}}/{{name}}/status", self.status, methods=["GET", "PUT", "PATCH"]
            ),
            *self._more_routes(),
        ]
        return Starlette(routes=routes, middleware=[
            Middleware(Authentication, tokens=self.tokens), Middleware(WarningHeaders)],
                         exception_handlers={
            404: lambda request, exc: error_response(no_such_resource()),
            405: lambda request, exc: error_response(StoreError(
                405, "MethodNotAllowed",
                "the server does not allow this method on the requested resource")),
        })

    def _more_routes(self) -> list[Route]:
        """Cluster-scoped core kinds (namespaces) and the API groups (apps, batch)."""
        item_methods = ["GET", "PUT", "PATCH", "DELETE"]
        sub_methods = ["GET", "PUT", "PATCH"]
        group = "/apis/{group}/{version}"
        group_ns = f"{group}/namespaces/{{namespace}}"
        return [
            Route("/api/v1/{resource}/{name}", self.item, methods=item_methods),
            Route("/api/v1/{resource}/{name}/status", self.status, methods=sub_methods),
            Route(f"{group}/{{resource}}", self.collection, methods=["GET", "POST"]),
            Route(f"{group_ns}/{{resource}}", self.collection, methods=["GET", "POST"]),
            Route(f"{group}/{{resource}}/{{name}}", self.item, methods=item_methods),
            Route(f"{group_ns}/{{resource}}/{{name}}", self.item, methods=item_methods),
            Route(f"{group_ns}/{{resource}}/{{name}}/status", self.status, methods=sub_methods),
            Route(f"{group_ns}/{{resource}}/{{name}}/scale", self.scale, methods=sub_methods),
        ]

    # --- small endpoints ----------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return Response("ok", media_type="text/plain")

    async def version(self, request: Request) -> Response:
        return JSONResponse(
            {"major": "1", "minor": "31", "gitVersion": "v1.31.0-kube-sim", "platform": "linux"}
        )

    async def api_versions(self, request: Request) -> Response:
        return JSONResponse(discovery.api_versions(request.url.netloc))

    @staticmethod
    def types() -> list[discovery.ResourceType]:
        return discovery.all_types(RESOURCES, CLUSTER_SCOPED)

    async def core_resources(self, request: Request) -> Response:
        return JSONResponse(discovery.resource_list(self.types(), "", "v1"))

    async def api_groups(self, request: Request) -> Response:
        return JSONResponse(discovery.api_group_list(self.types()))

    async def api_group(self, request: Request) -> Response:
        found = discovery.api_group(self.types(), request.path_params["group"])
        return JSONResponse(found) if found else error_response(no_such_resource())

    async def group_resources(self, request: Request) -> Response:
        found = discovery.resource_list(
            self.types(), request.path_params["group"], request.path_params["version"]
        )
        return JSONResponse(found) if found else error_response(no_such_resource())

    async def openapi_root(self, request: Request) -> Response:
        return JSONResponse(discovery.openapi_root(self.types()))

    async def openapi_document(self, request: Request) -> Response:
        found = discovery.openapi_for_path(self.types(), request.path_params["path"])
        return JSONResponse(found) if found else error_response(no_such_resource())

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
        described = discovery.by_kind(kind) if kind else None
        if described is not None and (
            described.group != request.path_params.get("group", "")
            or described.version != request.path_params.get("version", "v1")
        ):
            kind = None  # e.g. /api/v1/.../deployments: apps/v1 only
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
        if not raw:
            return None
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type == protobuf.MEDIA_TYPE:  # kubectl's typed clients (create namespace...)
            return protobuf.read(raw)
        if content_type == "application/yaml":
            return await bodies.parse_yaml(raw)  # depth, aliases, off the event loop
        if content_type not in JSON_BODIES:  # CBOR among them: client-go then falls back
            raise StoreError(415, "UnsupportedMediaType", UNKNOWN_FORMAT)
        try:
            # numbers keep their text: a quantity written 1e3 stays in the exponent family;
            # nesting bounded as kube-apiserver's decoder bounds it (bodies.py)
            return bodies.parse_json(raw, parse_float=JsonNumber.of,
                                     object_pairs_hook=schema.has_duplicates)
        except schema.DuplicateKeys:  # the last one wins; fieldValidation says what to tell
            request.state.duplicates = schema.duplicate_fields(raw, JsonNumber.of)
            return bodies.parse_json(raw, parse_float=JsonNumber.of)
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
            try:
                selector = Selector(
                    namespace=namespace,
                    label_requirements=parse_labels(query.get("labelSelector")),
                    field_requirements=parse_fields(query.get("fieldSelector")),
                )
            except SelectorError as exc:
                raise StoreError(400, "BadRequest", str(exc)) from exc
            allowed = FIELD_LABELS.get(kind, set()) | {"metadata.name", "metadata.namespace"}
            for requirement in selector.field_requirements:
                if requirement.key not in allowed:
                    raise StoreError(
                        400, "BadRequest", f"field label not supported: {requirement.key}"
                    )
            if query.get("watch") in ("true", "1"):
                return self._watch(request, kind, selector)
            listed = self._list(kind, selector, query.get("limit"), query.get("continue"))
            if tables.wants_table(request.headers.get("accept", "")):
                body = json.loads(listed.body)
                for item in body["items"]:
                    item.setdefault("kind", kind)
                return JSONResponse(
                    tables.table(kind, body["items"], self.now(),
                                 query.get("includeObject", "Metadata"), body["metadata"])
                )
            return listed
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
        count = int64_param("limit", limit)
        if count is not None and count > 0 and len(items) > count:
            items = items[:count]
            last = items[-1]["metadata"]
            meta["continue"] = encode_continue(version, (last.get("namespace", ""), last["name"]))
            meta["remainingItemCount"] = 0
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return JSONResponse(
            {"kind": f"{kind}List", "apiVersion": discovery.api_version_of(kind) or "v1",
             "metadata": meta, "items": items}
        )

    async def _create(self, request: Request, kind: str, namespace: str) -> Response:
        obj = await self._body(request)
        dry_run = request.query_params.get("dryRun") == "All"
        warnings = field_warnings(request, kind, obj)
        created = await self.create_object(kind, namespace, obj, dry_run)
        return with_warnings(JSONResponse(created, 201), warnings)

    def _namespace_labels(self, meta: dict[str, Any]) -> dict[str, str]:
        try:
            found = self.store.get("Namespace", "", str(meta.get("namespace") or "default"))
        except StoreError:
            return {}
        return (found.get("metadata") or {}).get("labels") or {}

    def ensure_namespace(self, name: str) -> None:
        """Namespaces exist once named: kube-sim creates one on first use (kube-apiserver
        refuses objects in a namespace nobody created; kube-sim's callers never create them)."""
        if not name:
            return
        try:
            self.store.get("Namespace", "", name)
        except StoreError:
            with contextlib.suppress(StoreError):
                self.store.create("Namespace", namespace_object(name))

    async def create_object(
        self, kind: str, namespace: str, obj: Any, dry_run: bool = False
    ) -> KubeObject:
        """POST's semantics: defaults, admission (pods), validation, store. Controllers use it
        too, so the pods they make pass the admission webhook as on a real cluster."""
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
        for field in ("uid", "resourceVersion", "deletionTimestamp", "generation"):
            meta.pop(field, None)
        decoded(kind, obj)  # canonical quantities, before admission sees the object
        if kind == "Pod":
            obj = self._pod_defaults(obj)
            for admit in self.pod_admitters:
                obj = admit(obj)
            if self.admit_pod is not None and not dry_run:
                obj = decoded(kind, await self.admit_pod(obj, "CREATE"))
            validation.validate_pod(obj)
            dra_objects.validate_pod_claims(obj)
        elif kind in WORKLOADS:
            validation.prepare_workload(kind, obj)
            obj["status"] = {}
        elif kind == "ResourceQuota":
            quota_status(obj)
        elif kind in dra_objects.KINDS:
            dra_objects.prepare(kind, obj)
            if kind not in CLUSTER_SCOPED:
                dra_objects.check_admin_access(kind, obj, self._namespace_labels(meta))
            if self.validate_dra is not None and not dry_run:
                await self.validate_dra(kind, obj, "CREATE", None)
            if kind == "ResourceClaim":  # the ResourceQuota admission plugin, last
                dra_quota.admit_claim(self.store, obj)
        elif kind == "Namespace":
            obj = {**namespace_object(meta.get("name", "")), **obj,
                   "status": {"phase": "Active"}}
            validation.raise_if("Namespace", obj, validation.validate_name(obj["metadata"]))
        if dry_run:
            return obj
        if kind not in CLUSTER_SCOPED:
            self.ensure_namespace(obj["metadata"]["namespace"])
        created = self.store.create(kind, obj)
        if kind == "Job":
            created = self.store.mutate(
                "Job", created["metadata"]["namespace"], created["metadata"]["name"],
                job_selector,
            )
        if kind == "Event":
            self.store.trim("Event", EVENTS_KEPT)
        return created

    @staticmethod
    def _pod_defaults(pod: KubeObject) -> KubeObject:
        pod.setdefault("spec", {})
        validation.prepare_pod(pod)
        pod["metadata"].setdefault("labels", {})
        pod["metadata"].setdefault("annotations", {})
        pod["status"] = {"phase": "Pending", "qosClass": qos_class(pod["spec"])}
        return pod

    def _watch(self, request: Request, kind: str, selector: Selector) -> Response:
        query = request.query_params
        raw_version = query.get("resourceVersion") or ""
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        initial: list[KubeObject] = []
        error: StoreError | None = None
        watcher = None
        # A streaming list (client-go's WatchList): the current state as ADDED events, then a
        # bookmark annotated `k8s.io/initial-events-end`, then the changes.
        initial_end = query.get("sendInitialEvents") == "true"
        if raw_version in ("", "0") or initial_end:
            # "Most recent": the current objects as ADDED, then every change after.
            initial = self.store.list(kind, selector)
            watcher = self.store.watch(kind, selector, self.store.version, copies=False)
        else:
            try:
                since = int(raw_version)
                if since > self.store.version:
                    raise gone(since)  # from another incarnation of the server: relist
                watcher = self.store.watch(kind, selector, since, copies=False)
            except ValueError:
                error = StoreError(400, "BadRequest", f"invalid resourceVersion {raw_version!r}")
            except StoreError as exc:
                error = exc
        store = self.store
        interval = self.bookmark_interval_s
        as_table = tables.wants_table(request.headers.get("accept", ""))
        include = query.get("includeObject", "Metadata")
        now = self.now
        encoded = self.encoded_events

        def line(event_type: str, obj: KubeObject) -> bytes:
            if as_table and event_type in ("ADDED", "MODIFIED", "DELETED"):
                obj = tables.table(kind, [obj], now(), include,
                                   {"resourceVersion": obj["metadata"].get("resourceVersion")})
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
                if initial_end:
                    yield line("BOOKMARK", {
                        "kind": kind,
                        "apiVersion": discovery.api_version_of(kind) or "v1",
                        "metadata": {"resourceVersion": str(watcher.since),
                                     "annotations": {"k8s.io/initial-events-end": "true"}},
                    })
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
                    # (the stored object itself: read, never changed, and encoded once for
                    # every stream that sends it)
                    yield line(event_type, obj) if as_table else encoded.line(event_type, obj)
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
                found = self.store.get(kind, namespace, name)
                if tables.wants_table(request.headers.get("accept", "")):
                    include = request.query_params.get("includeObject", "Metadata")
                    return JSONResponse(tables.table(kind, [found], self.now(), include))
                return JSONResponse(found)
            if request.method == "DELETE":
                body = await self._body(request)
                uid = None
                policy = request.query_params.get("propagationPolicy")
                if isinstance(body, dict):
                    uid = (body.get("preconditions") or {}).get("uid")
                    policy = body.get("propagationPolicy") or policy
                if request.query_params.get("dryRun") == "All":
                    return JSONResponse(self.store.get(kind, namespace, name))
                return JSONResponse(self.delete_object(kind, namespace, name, uid, policy))
            if request.method == "PUT":
                return await self._replace(request, kind, namespace, name)
            if request.headers.get("content-type", "").startswith("application/apply-patch"):
                return await self._apply(request, kind, namespace, name)
            return await self._patch(request, kind, namespace, name, status_only=False)
        except StoreError as error:
            return error_response(error)

    async def pod_log(self, request: Request) -> Response:
        """`kubectl logs`: what the container's process wrote (kube-sim runs containers as
        processes only with RUN_CONTAINERS; otherwise a container has written nothing)."""
        try:
            namespace, name = request.path_params["namespace"], request.path_params["name"]
            pod = self.store.get("Pod", namespace, name)
            names = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or []]
            container = request.query_params.get("container")
            if not container:
                if len(names) != 1:
                    raise StoreError(400, "BadRequest", f"a container name must be specified "
                                     f"for pod {name}, choose one of: [{' '.join(names)}]")
                container = names[0]
            if container not in names:
                raise StoreError(400, "BadRequest",
                                 f"container {container} is not valid for pod {name}")
            kubelet = self.kubelets.get((pod.get("spec") or {}).get("nodeName") or "")
            processes = getattr(kubelet, "processes", None)
            text = ""
            if processes is not None:
                path = processes.log_dir / f"{name}_{container}.log"
                if path.is_file():
                    text = path.read_text(errors="replace")
            tail = int64_param("tailLines", request.query_params.get("tailLines"))
            if tail is not None and tail >= 0:
                text = "".join(text.splitlines(keepends=True)[-tail:]) if tail else ""
            return Response(text, media_type="text/plain")
        except StoreError as error:
            return error_response(error)

    def delete_object(
        self, kind: str, namespace: str, name: str, uid: str | None = None,
        policy: str | None = None,
    ) -> KubeObject:
        """DELETE's semantics, controllers included. Dependents (ownerReferences) go with their
        owner (`Background`, `Foreground`: at once, in kube-sim) or are released (`Orphan`, the
        API's default for batch/v1 Jobs); a namespace takes everything in it."""
        policy = policy or ("Orphan" if kind == "Job" else "Background")
        if policy not in ("Orphan", "Background", "Foreground"):
            raise StoreError(
                422, "Invalid", f'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: '
                f'Unsupported value: "{policy}": supported values: "Foreground", '
                '"Background", "Orphan", "nil"',
            )
        deleted = self.store.delete(kind, namespace, name, uid)
        if kind == "Pod":
            for callback in self.on_pod_deleted:
                callback(deleted)
        owner_uid = deleted["metadata"].get("uid", "")
        if kind in WORKLOADS:
            for dependent_kind in ("ReplicaSet", "Pod"):
                for dependent in self.store.list(dependent_kind, Selector(namespace=namespace)):
                    self._release_or_delete(dependent_kind, dependent, owner_uid, policy)
        if kind == "Namespace":
            for other in self.store.kinds():
                if other in CLUSTER_SCOPED or other == "Namespace":
                    continue
                for obj in self.store.list(other, Selector(namespace=name)):
                    with contextlib.suppress(StoreError):
                        self.delete_object(other, name, obj["metadata"]["name"], None,
                                           "Background")
        return deleted

    def _release_or_delete(
        self, kind: str, obj: KubeObject, owner_uid: str, policy: str
    ) -> None:
        refs = obj["metadata"].get("ownerReferences") or []
        if not any(r.get("uid") == owner_uid for r in refs):
            return
        namespace, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
        with contextlib.suppress(StoreError):
            if policy == "Orphan":

                def release(o: KubeObject) -> None:
                    kept = [r for r in o["metadata"].get("ownerReferences") or []
                            if r.get("uid") != owner_uid]
                    o["metadata"]["ownerReferences"] = kept
                    if not kept:
                        del o["metadata"]["ownerReferences"]

                self.store.mutate(kind, namespace, name, release)
            else:
                self.delete_object(kind, namespace, name, None, "Background")

    async def scale(self, request: Request) -> Response:
        """`<workload>/scale` (autoscaling/v1 Scale), what `kubectl scale` talks to."""
        try:
            kind = self._kind(request)
            if kind not in ("Deployment", "ReplicaSet"):
                raise no_such_resource()
            namespace = request.path_params["namespace"]
            name = request.path_params["name"]
            if request.method != "GET":
                body = await self._body(request)
                if not isinstance(body, dict):
                    raise StoreError(400, "BadRequest", "the body must be a Scale object")
                replicas = (body.get("spec") or {}).get("replicas")
                if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                    raise validation.invalid("Scale", name, [validation.FieldError(
                        "Invalid", "spec.replicas", "must be greater than or equal to 0",
                        replicas)])
                expected = (body.get("metadata") or {}).get("resourceVersion")

                def set_replicas(obj: KubeObject) -> None:
                    if expected and str(expected) != obj["metadata"].get("resourceVersion"):
                        raise conflict(
                            f'Operation cannot be fulfilled on {discovery.qualified_resource(kind)}'
                            f' "{name}": the object has been modified; please apply your changes'
                            " to the latest version and try again"
                        )
                    obj["spec"]["replicas"] = replicas

                self.store.mutate(kind, namespace, name, set_replicas)
            return JSONResponse(scale_of(self.store.get(kind, namespace, name)))
        except StoreError as error:
            return error_response(error)

    async def _apply(self, request: Request, kind: str, namespace: str, name: str) -> Response:
        """Server-side apply (`kubectl apply --server-side`), simplified: the applied
        configuration is created, or merged into the object as a strategic merge patch (no
        field ownership tracking)."""
        applied = await bodies.parse_yaml(await request.body())  # 413, depth, aliases, thread
        if not isinstance(applied, dict):
            raise StoreError(400, "BadRequest", "the body must be an object")
        warnings = field_warnings(request, kind, applied)
        applied.setdefault("metadata", {})["name"] = name
        dry_run = _dry_run(request)
        try:
            self.store.get(kind, namespace, name)
        except StoreError:
            created = await self.create_object(kind, namespace, applied, dry_run)
            return with_warnings(JSONResponse(created, 201), warnings)
        applied.pop("status", None)
        return with_warnings(JSONResponse(await self._update(
            kind, namespace, name, applied, strategic_merge.apply, dry_run)), warnings)

    async def _update(
        self, kind: str, namespace: str, name: str, patch: Any,
        merge: Callable[[Any, Any], Any], dry_run: bool = False,
    ) -> KubeObject:
        def change(obj: KubeObject) -> None:
            before = copy.deepcopy(obj)
            patched = merge(obj, patch)
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata"), dict):
                raise StoreError(422, "Invalid", "the patch removed metadata")
            for key in IMMUTABLE_META:
                if before["metadata"].get(key) is None:
                    patched["metadata"].pop(key, None)
                else:
                    patched["metadata"][key] = before["metadata"][key]
            validate_update(kind, before, decoded(kind, patched))
            obj.clear()
            obj.update(patched)

        return await self._admitted(kind, namespace, name, change, "", not dry_run)

    async def _admitted(
        self, kind: str, namespace: str, name: str, change: Callable[[KubeObject], None],
        sub_resource: str, persist: bool, precondition: str | None = None,
    ) -> KubeObject:
        """A change of a stored object; a pod's goes through UPDATE admission (updates.py)."""

        def check(old: KubeObject, new: KubeObject) -> None:
            if not sub_resource:
                validate_update(kind, old, decoded(kind, new))

        return await admitted_change(
            self.store, kind, namespace, name, change, self._update_admission(kind),
            sub_resource, persist, check, precondition,
        )

    def _update_admission(self, kind: str) -> AdmitUpdate | None:
        """What reviews an UPDATE of `kind`: a pod's admission chain; for a DRA object, the
        validating webhook (`operation: UPDATE`, the stored object as `oldObject`), on the
        object itself only: the chart's rules name no subresource, so `/status` is not sent."""
        if kind == "Pod":
            return self.admit_update
        validate = self.validate_dra
        if kind not in dra_objects.KINDS or validate is None:
            return None

        async def reviewed(new: KubeObject, old: KubeObject, sub_resource: str) -> KubeObject:
            if not sub_resource:
                await validate(kind, new, "UPDATE", old)
            return new

        return reviewed

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
                    if kind == "Pod" and isinstance(body.get("metadata"), dict):
                        # metadata but the spec too (updates.py), immutable fields kept
                        kept = {k: obj["metadata"].get(k) for k in IMMUTABLE_META}
                        changed = status_update(obj, {**obj, "metadata": body["metadata"]})
                        for key, value in kept.items():
                            if value is None:
                                changed["metadata"].pop(key, None)
                            else:
                                changed["metadata"][key] = value
                        obj["metadata"] = changed["metadata"]
                    obj["status"] = new_status

                wanted = (body.get("metadata") or {}).get("resourceVersion")
                return JSONResponse(await self._admitted(
                    kind, namespace, name, set_status, "status", True,
                    str(wanted) if wanted and kind == "Pod" else None))
            return await self._patch(request, kind, namespace, name, status_only=True)
        except StoreError as error:
            return error_response(error)

    async def _replace(self, request: Request, kind: str, namespace: str, name: str) -> Response:
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise StoreError(400, "BadRequest", "the body must be an object with metadata")
        warnings = field_warnings(request, kind, body)
        body["metadata"]["name"] = name
        if kind not in CLUSTER_SCOPED:
            body["metadata"]["namespace"] = namespace
        expected = body["metadata"].get("resourceVersion")
        current = self.store.get(kind, namespace if kind not in CLUSTER_SCOPED else "", name)
        if kind in WORKLOADS or kind == "Pod":
            body.setdefault("status", current.get("status", {}))
        validate_update(kind, current, decoded(kind, body))
        if self._update_admission(kind) is not None:  # UPDATE admission (precondition kept)

            def put(obj: KubeObject) -> None:
                obj.clear()
                obj.update(copy.deepcopy(body))

            replaced = await self._admitted(kind, namespace, name, put, "",
                                            not _dry_run(request), str(expected or "") or None)
        else:
            replaced = self.store.replace(kind, body, str(expected) if expected else None,
                                          persist=not _dry_run(request))
        return with_warnings(JSONResponse(replaced), warnings)

    async def _patch(
        self, request: Request, kind: str, namespace: str, name: str, status_only: bool
    ) -> Response:
        patch = await self._body(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        warnings = (
            field_warnings(request, kind, patch)
            if content_type != "application/json-patch+json" and not status_only
            else []
        )

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
                if content_type == "application/strategic-merge-patch+json":
                    try:
                        patched = strategic_merge.apply(obj, patch)
                    except strategic_merge.PatchError as exc:
                        raise StoreError(422, "Invalid", str(exc)) from exc
                else:
                    patched = merge_patch(obj, patch)
            else:
                raise StoreError(
                    415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"
                )
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata"), dict):
                raise StoreError(422, "Invalid", "the patch removed metadata")
            if status_only and kind == "Pod":  # metadata but the spec too (updates.py)
                patched = status_update(obj, patched)
            elif status_only:
                patched = {**obj, "status": patched.get("status", {})}
            for key, value in before.items():
                if value is None:
                    patched["metadata"].pop(key, None)
                else:
                    patched["metadata"][key] = value
            if not status_only:
                validate_update(kind, obj, decoded(kind, patched))
            obj.clear()
            obj.update(patched)

        changed = await self._admitted(
            kind, namespace, name, apply, "status" if status_only else "", not _dry_run(request))
        return with_warnings(JSONResponse(changed), warnings)

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

