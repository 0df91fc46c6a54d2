"""AdmissionReview in and out (admission.k8s.io/v1, and v1beta1 answered as v1beta1). Pure."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from tessera.settings import TesseraSettings

from .rules import Admitted, Decision, Denial, decide, decide_update

API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
NOT_A_POD = "NotAPod"


class ReviewError(ValueError):
    """A body that is not an AdmissionReview we can answer: HTTP `status` with `message`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Review:
    """The parts of an AdmissionReview request the webhook uses."""

    api_version: str
    uid: str
    operation: str
    namespace: str
    name: str
    group: str
    kind: str
    resource: str
    sub_resource: str
    object: Any
    dry_run: bool
    old_object: Any = None
    username: str = ""


# A pod's or DRA object's deepest path (managedFields' fieldsV1, opaque parameters) is a few
# dozen levels; the rules and the DRA conversion copy and diff recursively (Python's stack).
MAX_DEPTH = 100


def _nested_deeper(document: Any, limit: int) -> bool:
    """Whether `document` nests lists and objects more than `limit` levels (no recursion)."""
    level: list[Any] = [document]
    for _ in range(limit):
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, dict | list)]  # fmt: skip
        if not level:
            return False
    return True


def parse_review(body: bytes) -> Review:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ReviewError(f"body is not JSON: {str(exc)[:200]}") from exc
    if not isinstance(document, dict):
        raise ReviewError("body must be a JSON object (an AdmissionReview)")
    if _nested_deeper(document, MAX_DEPTH):
        raise ReviewError(f"AdmissionReview nested deeper than {MAX_DEPTH} levels: no pod or "
                          "DRA object is; refused before the rules copy it")  # fmt: skip
    if document.get("kind") != "AdmissionReview":
        raise ReviewError(f"expected kind AdmissionReview, got {_short(document.get('kind'))}")
    api_version = document.get("apiVersion")
    if api_version not in API_VERSIONS:
        raise ReviewError(
            f"unsupported apiVersion {_short(api_version)}; use one of {', '.join(API_VERSIONS)}"
        )
    request = document.get("request")
    if not isinstance(request, dict):
        raise ReviewError("AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid or len(uid) > 256:
        raise ReviewError("AdmissionReview request.uid must be a non-empty string")
    kind = request.get("kind")
    resource = request.get("resource")
    user_info = request.get("userInfo")
    return Review(
        api_version=api_version,
        uid=uid,
        operation=_text(request.get("operation")),
        namespace=_text(request.get("namespace")) or _pod_namespace(request.get("object")),
        name=_text(request.get("name")),
        group=_text(kind.get("group")) if isinstance(kind, dict) else "",
        kind=_text(kind.get("kind")) if isinstance(kind, dict) else "",
        resource=_text(resource.get("resource")) if isinstance(resource, dict) else "",
        sub_resource=_text(request.get("subResource")),
        object=request.get("object"),
        dry_run=request.get("dryRun") is True,
        old_object=request.get("oldObject"),
        username=_text(user_info.get("username")) if isinstance(user_info, dict) else "",
    )


# Pod subresources whose UPDATE carries the whole pod, metadata included.
ANNOTATING_SUBRESOURCES = ("status", "ephemeralcontainers", "resize")


def review_decision(review: Review, settings: TesseraSettings) -> Decision:
    """Route a review to the pod rules. Creations get every rule; a pod update is checked only
    for changes to scheduler-owned annotations; anything else passes (so a webhook registered too
    widely never blocks other objects' updates or deletions). Creating anything but a pod is
    refused, which makes such a registration visible at once."""
    if review.operation == "UPDATE" and _is_pod(review) and (
        not review.sub_resource or review.sub_resource in ANNOTATING_SUBRESOURCES
    ):
        # pods/status (and the other pod subresources an UPDATE reaches) can carry metadata
        # changes too: whoever may write them may not set or change the allocation's record.
        return decide_update(review.old_object, review.object, review.username, settings)
    if review.operation != "CREATE":
        return Admitted(note=f"operation {review.operation or '?'} is not reviewed")
    if review.group != "" or review.kind != "Pod" or review.resource not in ("", "pods"):
        what = "/".join(p for p in (review.group, review.kind) if p) or "an object of no kind"
        return Denial(
            NOT_A_POD,
            f"tessera-admission reviews pods only, got {what}; fix the rules of the "
            "MutatingWebhookConfiguration",
            400,
        )
    if review.sub_resource:
        return Admitted(note=f"subresource {review.sub_resource} is not reviewed")
    return decide(review.object, review.namespace, settings)


def response_body(review: Review, decision: Decision) -> bytes:
    """The AdmissionReview answer, in the apiVersion the request used."""
    response: dict[str, Any] = {"uid": review.uid}
    if isinstance(decision, Denial):
        response["allowed"] = False
        # status.reason stays unset: Kubernetes reserves it for its own StatusReason values.
        response["status"] = {"code": decision.code, "message": decision.message}
    else:
        response["allowed"] = True
        if decision.patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(
                json.dumps(decision.patch, separators=(",", ":")).encode()
            ).decode()
        if decision.warnings:
            response["warnings"] = list(decision.warnings)
    answer = {"apiVersion": review.api_version, "kind": "AdmissionReview", "response": response}
    return json.dumps(answer, separators=(",", ":")).encode()


def _is_pod(review: Review) -> bool:
    return review.group == "" and review.kind == "Pod" and review.resource in ("", "pods")


def _pod_namespace(pod: Any) -> str:
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    namespace = metadata.get("namespace") if isinstance(metadata, dict) else None
    return namespace if isinstance(namespace, str) else ""


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _short(value: Any) -> str:
    return repr(value)[:80]
