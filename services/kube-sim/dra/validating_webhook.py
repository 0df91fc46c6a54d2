"""Calling Tessera's validating webhook for DRA objects, as kube-apiserver does.

The admission chart registers, in DRA mode, a ValidatingWebhookConfiguration with one webhook per
resource (`resourceclaims`, `resourceclaimtemplates`, `deviceclasses` of `resource.k8s.io/v1`,
CREATE and UPDATE), path `/validate`, each with a match condition: only an object carrying
opaque configuration for `gpu.tessera.io` is sent (`MATCH_CONDITIONS`, evaluated here in CEL as
kube-apiserver does, KEP-3716). kube-apiserver calls validating webhooks after mutating
admission and the object's own validation, and a denial is the request's error:
`admission webhook "<name>" denied the request: <message>`; nothing is stored. kube-sim calls it
as the rules name it: on CREATE, and on UPDATE (PUT, PATCH, server-side apply) of the object
itself with the stored object as `oldObject` (a DeviceClass's `config` may change; a claim's or
template's spec is immutable, but an update of their metadata is sent all the same, as
kube-apiserver sends it). `/status` is a subresource the rules do not name: not sent. kube-sim's
own controllers write through the store, not the HTTP API, so their writes are not reviewed.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import celpy
from tessera.kube_sim.admission import OPTIONS_KIND, AdmissionWebhook
from tessera.kube_sim.http_client import HttpError
from tessera.kube_sim.identity import current_user
from tessera.kube_sim.store import KubeObject, StoreError

log = logging.getLogger("tessera.kube_sim.dra")

PLURALS = {"ResourceClaim": "resourceclaims", "ResourceClaimTemplate": "resourceclaimtemplates",
           "DeviceClass": "deviceclasses"}  # fmt: skip
_CONFIG_AT = {"resourceclaims": "object.spec.devices",
              "resourceclaimtemplates": "object.spec.spec.devices", "deviceclasses": "object.spec"}
# resource -> the chart's match condition (charts/tessera-admission, kept equal by its test)
MATCH_CONDITIONS = {
    resource: f"has({at}.config) && {at}.config.exists(c, has(c.opaque) && "
    "c.opaque.driver == 'gpu.tessera.io')"
    for resource, at in _CONFIG_AT.items()
}


def validate_url(mutate_url: str) -> str:
    """The webhook service's `/validate`, beside the `/mutate` kube-sim is configured with."""
    base = mutate_url.removesuffix("/mutate") if mutate_url.endswith("/mutate") else mutate_url
    return f"{base.rstrip('/')}/validate"


class DraValidatingWebhook:
    """The chart's DRA ValidatingWebhookConfiguration, as kube-apiserver applies it."""

    def __init__(self, webhook: AdmissionWebhook) -> None:
        self.webhook = webhook  # its URL is /validate; its TLS, timeout and failure policy
        env = celpy.Environment()
        self._conditions = {r: env.program(env.compile(e)) for r, e in MATCH_CONDITIONS.items()}

    def sent(self, resource: str, obj: KubeObject) -> bool:
        """The match condition (an evaluation error: sent, as `failurePolicy: Fail` has it)."""
        try:
            return bool(self._conditions[resource].evaluate({"object": celpy.json_to_cel(obj)}))
        except Exception:  # celpy raises its own error types for a missing field
            return True

    async def __call__(self, kind: str, obj: KubeObject, operation: str = "CREATE",
                       old: KubeObject | None = None) -> None:
        resource = PLURALS.get(kind)
        if resource is None or not self.sent(resource, obj):
            return
        name = f"{resource}.dra.admission.tessera.io"
        review_uid = str(uuid.uuid4())
        group_kind = {"group": "resource.k8s.io", "version": "v1", "kind": kind}
        group_resource = {"group": "resource.k8s.io", "version": "v1", "resource": resource}
        meta = obj.get("metadata") or {}
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": review_uid, "kind": group_kind, "resource": group_resource,
            "requestKind": group_kind, "requestResource": group_resource,
            "name": meta.get("name", ""), "namespace": meta.get("namespace", ""),
            "operation": operation, "userInfo": current_user().review(), "object": obj,
            "oldObject": old if operation == "UPDATE" else None, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": OPTIONS_KIND.get(operation, "")},
        }}  # fmt: skip
        try:
            review: Any = await self.webhook._send(body)
        except Exception as exc:  # unreachable, not 200, not JSON: the failure policy
            if self.webhook.failure_policy == "Ignore":
                log.warning("DRA webhook failed, ignored by policy", extra={"error": str(exc)})
                return
            reason = exc if isinstance(exc, HttpError | ValueError) else type(exc).__name__
            raise StoreError(500, "InternalError", f'Internal error occurred: failed calling '
                             f'webhook "{name}": {reason}') from exc  # fmt: skip
        response = review.get("response") if isinstance(review, dict) else None
        if not isinstance(response, dict) or response.get("uid") != review_uid:
            raise StoreError(500, "InternalError", f'Internal error occurred: failed calling '
                             f'webhook "{name}": the response uid does not match the request')
        if not response.get("allowed"):
            status = response.get("status") or {}
            code = int(status.get("code") or 400)
            raise StoreError(code if 400 <= code < 600 else 400,
                             "Forbidden" if code == 403 else "BadRequest",
                             f'admission webhook "{name}" denied the request: '
                             f'{status.get("message") or "denied"}')  # fmt: skip
