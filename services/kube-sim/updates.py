"""Pod updates through admission, as kube-apiserver's update path does.

kube-apiserver reads the stored pod, applies the request to a copy, runs the mutating and then
the validating admission webhooks on it (`operation: UPDATE`, the stored pod as `oldObject`,
the subresource if any, the requesting user), validates, and writes it only if the stored pod is
still the one it read; a patch without a resourceVersion precondition is retried against the
newer pod, a request that named a resourceVersion gets 409 Conflict.

pods/status: the pod's spec, deletionTimestamp and ownerReferences are kept from the stored pod;
the rest of its metadata (labels, annotations) and its status are taken from the request, as
kube-apiserver's pod status strategy does. That is why the webhook reviews pods/status too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tessera.kube_sim.store import KubeObject, ObjectStore, StoreError, clone

# (new pod, stored pod, subresource) -> the pod as admission leaves it, or StoreError
AdmitUpdate = Callable[[KubeObject, KubeObject, str], Awaitable[KubeObject]]
Change = Callable[[KubeObject], None]
ATTEMPTS = 5


def status_update(stored: KubeObject, requested: KubeObject) -> KubeObject:
    """What a pods/status write stores: the request's status and metadata, the stored spec."""
    result = clone(requested)
    result["spec"] = clone(stored.get("spec", {}))
    metadata = result.setdefault("metadata", {})
    for key in ("deletionTimestamp", "ownerReferences"):
        if key in stored.get("metadata", {}):
            metadata[key] = clone(stored["metadata"][key])
        else:
            metadata.pop(key, None)
    return result


async def admitted_change(
    store: ObjectStore, kind: str, namespace: str, name: str, change: Change,
    admit: AdmitUpdate | None, sub_resource: str = "", persist: bool = True,
    check: Callable[[KubeObject, KubeObject], None] | None = None,
    precondition: str | None = None,
) -> KubeObject:
    """Apply `change` to the stored object, through `admit` first (a pod's admission chain, a
    DRA object's validating webhook). `check(old, new)` validates the admitted result;
    `precondition` is a resourceVersion the client named."""
    if admit is None or not persist:
        return store.mutate(kind, namespace, name, change, persist=persist)
    for attempt in range(ATTEMPTS):
        # the stored pod itself, only read (the webhook's oldObject, the checks): the store
        # never changes it in place, so it stays what was read across the webhook's await
        stored = store.peek(kind, namespace, name)
        version = stored["metadata"].get("resourceVersion")
        if precondition and precondition != version:
            break  # the store's replace answers with kube-apiserver's conflict message
        updated = clone(stored)
        change(updated)
        admitted = await admit(updated, stored, sub_resource)
        if check is not None and admitted is not updated:
            check(stored, admitted)
        try:  # `admitted` is this attempt's own copy (or the webhook's patched one)
            return store.replace(kind, admitted, precondition or version, persist=persist,
                                 owned=True)
        except StoreError as error:
            if error.status != 409 or precondition or attempt == ATTEMPTS - 1:
                raise
    return store.replace(kind, store.get(kind, namespace, name), precondition, persist=persist)
