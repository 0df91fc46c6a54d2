"""Calling a mutating admission webhook as kube-apiserver does (AdmissionReview v1 over HTTPS).

kube-sim registers the webhook as the chart's MutatingWebhookConfiguration does (`RULES`): pods
on CREATE and UPDATE, and UPDATE of the pod subresources that carry the pod's metadata
(`pods/status`, ...). The pod is sent as `request.object` (on UPDATE the stored one as
`oldObject`, the subresource as `subResource`), the authenticated client as `userInfo`; an
allowed response's base64 JSON patch is applied to it; a denial becomes the request's error,
`admission webhook "<name>" denied the request: <msg>`; the response's `warnings` become the
client's `Warning` headers (`response_warnings`).
A webhook that cannot be reached follows the failure policy: `Fail` rejects the create with an
internal error (clients retry), `Ignore` lets the pod through unchanged.

The chart's `matchConditions` are kept too (`sent_to_webhook`): kube-apiserver sends a request
to a webhook only when every match condition holds (KEP-3716, GA in 1.30), and the chart's two
skip an UPDATE by the release's own service accounts (the scheduler's and the node agent's
annotation patches) and a subresource UPDATE that leaves the annotations as they were (a
status write). Those reach the store without a review, as on a cluster the chart installed.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import ssl
import uuid
from typing import Any, Literal

import httpx
import jsonpatch
from tessera.kube_sim.http_client import HttpError, JsonPoster
from tessera.kube_sim.identity import COMPONENT_NAMESPACE, UserInfo, current_user
from tessera.kube_sim.response_warnings import add_warning
from tessera.kube_sim.store import KubeObject, StoreError, clone

log = logging.getLogger("tessera.kube_sim.admission")

WEBHOOK_NAME = "vgpu.tessera.io"
# (operation, pod subresource) the webhook is called for: the chart's rules.
RULES = frozenset({
    ("CREATE", ""), ("UPDATE", ""),
    ("UPDATE", "status"), ("UPDATE", "ephemeralcontainers"), ("UPDATE", "resize"),
})
OPTIONS_KIND = {"CREATE": "CreateOptions", "UPDATE": "UpdateOptions"}
# The chart installs Tessera in this namespace; its components' service accounts live there.
RELEASE_ACCOUNTS = f"system:serviceaccount:{COMPONENT_NAMESPACE}:"


def _annotations(pod: KubeObject | None) -> dict[str, Any]:
    metadata = (pod or {}).get("metadata") or {}
    return metadata.get("annotations") or {}


def sent_to_webhook(
    operation: str, sub_resource: str, user: UserInfo, pod: KubeObject, old: KubeObject | None
) -> bool:
    """The chart's matchConditions (charts/tessera-admission, MutatingWebhookConfiguration):
    every one must hold for kube-apiserver to call the webhook.

    - skip-tessera-component-updates: `request.operation != 'UPDATE' ||
      !request.userInfo.username.startsWith('system:serviceaccount:<release namespace>:')`
    - subresource-updates-that-change-annotations: `!has(request.subResource) ||
      request.subResource == '' || object's annotations != oldObject's annotations`"""
    if operation == "UPDATE" and user.username.startswith(RELEASE_ACCOUNTS):
        return False
    return not sub_resource or _annotations(pod) != _annotations(old)


def admission_review(
    pod: KubeObject, operation: str, review_uid: str, old: KubeObject | None = None,
    sub_resource: str = "", user: UserInfo | None = None,
) -> dict[str, Any]:
    namespace = pod.get("metadata", {}).get("namespace", "")
    resource = {"group": "", "version": "v1", "resource": "pods"}
    kind = {"group": "", "version": "v1", "kind": "Pod"}
    request: dict[str, Any] = {
        "uid": review_uid,
        "kind": kind,
        "resource": resource,
        "requestKind": kind,
        "requestResource": resource,
        "name": pod.get("metadata", {}).get("name", ""),
        "namespace": namespace,
        "operation": operation,
        "userInfo": (user or current_user()).review(),
        "object": pod,
        "oldObject": old,
        "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": OPTIONS_KIND.get(operation, "")},
    }
    if sub_resource:
        request["subResource"] = request["requestSubResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def apply_review_response(pod: KubeObject, review: Any, review_uid: str) -> KubeObject:
    """The pod after the webhook's answer; StoreError for a denial or a malformed answer."""
    response = review.get("response") if isinstance(review, dict) else None
    if not isinstance(response, dict) or response.get("uid") != review_uid:
        raise StoreError(
            500,
            "InternalError",
            f'Internal error occurred: failed calling webhook "{WEBHOOK_NAME}": '
            "the response uid does not match the request",
        )
    for warning in response.get("warnings") or []:  # allowed or not, as kube-apiserver
        add_warning(str(warning))
    if not response.get("allowed"):
        result = response.get("status") or {}
        code = int(result.get("code") or 400)
        message = result.get("message") or "denied"
        raise StoreError(
            code if 400 <= code < 600 else 400,
            "Forbidden" if code == 403 else "BadRequest",
            f'admission webhook "{WEBHOOK_NAME}" denied the request: {message}',
        )
    patch_text = response.get("patch")
    if not patch_text:
        return pod
    if response.get("patchType") != "JSONPatch":
        raise StoreError(500, "InternalError", "webhook returned a patch of an unknown type")
    try:
        operations = json.loads(base64.b64decode(patch_text))
        return jsonpatch.apply_patch(clone(pod), operations, in_place=True)  # one copy, not two
    except (
        ValueError,
        binascii.Error,
        jsonpatch.JsonPatchException,
        jsonpatch.JsonPointerException,
        TypeError,
    ) as exc:
        raise StoreError(
            500, "InternalError", f'failed to apply the patch of webhook "{WEBHOOK_NAME}": {exc}'
        ) from exc


class AdmissionWebhook:
    """The webhook configuration kube-sim calls for pod CREATEs and UPDATEs (`RULES`, under
    the chart's match conditions: `sent_to_webhook`)."""

    def __init__(
        self,
        url: str,
        ca_file: str | None,
        timeout_s: float = 10.0,
        failure_policy: Literal["Fail", "Ignore"] = "Fail",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self.failure_policy = failure_policy
        tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
        # `transport`: tests serve the webhook's own ASGI app in-process (through httpx); else
        # kube-sim's own client (http_client.py)
        self._client = (httpx.AsyncClient(timeout=timeout_s, transport=transport)
                        if transport is not None else None)  # fmt: skip
        self._poster = JsonPoster(url, tls, timeout_s) if transport is None else None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        if self._poster is not None:
            await self._poster.close()

    async def _send(self, body: dict[str, Any]) -> Any:
        """POST the review; the decoded answer (HttpError/ValueError when there is none)."""
        if self._client is not None:
            answer = await self._client.post(self.url, json=body)
            status, text, content = answer.status_code, answer.text, answer.content
        else:
            assert self._poster is not None
            reply = await self._poster.post("", body)
            status, content = reply.status, reply.body
            text = reply.text if status != 200 else ""
        if status != 200:
            raise HttpError(f"HTTP {status}: {text[:200]}")
        return json.loads(content)

    async def __call__(self, pod: KubeObject, operation: str) -> KubeObject:
        return await self.review(pod, operation)

    async def update(self, pod: KubeObject, old: KubeObject, sub_resource: str) -> KubeObject:
        """An UPDATE of the pod (or of its subresource): the pod as the webhook leaves it."""
        if ("UPDATE", sub_resource) not in RULES or not sent_to_webhook(
            "UPDATE", sub_resource, current_user(), pod, old
        ):
            return pod
        return await self.review(pod, "UPDATE", old, sub_resource)

    async def review(
        self, pod: KubeObject, operation: str, old: KubeObject | None = None,
        sub_resource: str = "",
    ) -> KubeObject:
        review_uid = str(uuid.uuid4())
        body = admission_review(pod, operation, review_uid, old, sub_resource)
        try:
            review = await self._send(body)
        except (HttpError, httpx.HTTPError, ValueError) as exc:
            if self.failure_policy == "Ignore":
                log.warning("webhook failed, ignored by policy", extra={"error": str(exc)})
                return pod
            raise StoreError(
                500,
                "InternalError",
                f'Internal error occurred: failed calling webhook "{WEBHOOK_NAME}": '
                f'failed to call webhook: Post "{self.url}": {exc or type(exc).__name__}',
            ) from exc
        return apply_review_response(pod, review, review_uid)
