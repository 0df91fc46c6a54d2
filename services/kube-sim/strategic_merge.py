"""Strategic merge patch (`application/strategic-merge-patch+json`), as kubectl apply sends it.

Like a JSON merge patch, except that lists with a patch merge key merge element by element
(`containers` by `name`, `env` by `name`, `volumeMounts` by `mountPath`, ...) and the directives
kubectl writes are honoured: `$patch: replace|delete|merge`, `$setElementOrder/<list>`,
`$deleteFromPrimitiveList/<list>`, `$retainKeys`. The merge keys are those the Kubernetes API
types declare (`patchMergeKey`) for the fields kube-sim's kinds carry, looked up by field name.
Lists without one are replaced, as for atomic lists. Pure functions.
"""

from __future__ import annotations

from typing import Any

MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "ports": "containerPort",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "conditions": "type",
    "hostAliases": "ip",
    "resourceClaims": "name",
    "topologySpreadConstraints": "topologyKey",
}
# Lists of scalars merged as sets (patchStrategy merge).
MERGED_SCALAR_LISTS = {"finalizers"}


class PatchError(ValueError):
    """The patch cannot be applied (kube-apiserver answers 422 or 400)."""


def apply(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    orders = {k.split("/", 1)[1]: v for k, v in patch.items() if k.startswith("$setElementOrder/")}
    for key, value in patch.items():
        if key.startswith("$"):
            if key.startswith("$deleteFromPrimitiveList/"):
                field = key.split("/", 1)[1]
                gone = value if isinstance(value, list) else []
                result[field] = [v for v in result.get(field) or [] if v not in gone]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            merged = apply(result.get(key), value)
            if merged is None and isinstance(value, dict):
                result.pop(key, None)
            else:
                result[key] = merged
    for field, order in orders.items():
        if isinstance(result.get(field), list):
            result[field] = _reorder(field, result[field], order)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    current = current if isinstance(current, list) else []
    if field in MERGED_SCALAR_LISTS:
        return current + [v for v in patch if v not in current]
    key = MERGE_KEYS.get(field)
    if key is None or not all(isinstance(p, dict) for p in patch):
        if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
            return [p for p in patch if not (isinstance(p, dict) and "$patch" in p)]
        return patch
    merged = [dict(c) if isinstance(c, dict) else c for c in current]
    for element in patch:
        directive = element.get("$patch")
        if directive == "replace":
            return [p for p in patch if p.get("$patch") != "replace"]
        if key not in element:
            raise PatchError(f"map: {element} does not contain declared merge key: {key}")
        index = next(
            (i for i, c in enumerate(merged) if isinstance(c, dict) and c.get(key) == element[key]),
            None,
        )
        if directive == "delete":
            if index is not None:
                merged.pop(index)
            continue
        if index is None:
            merged.append(apply({}, element))
        else:
            merged[index] = apply(merged[index], element)
    return merged


def _reorder(field: str, items: list[Any], order: list[Any]) -> list[Any]:
    key = MERGE_KEYS.get(field)

    def identity(item: Any) -> Any:
        return item.get(key) if key and isinstance(item, dict) else item

    wanted = [identity(o) for o in order]
    ranked = sorted(
        range(len(items)),
        key=lambda i: (
            wanted.index(identity(items[i])) if identity(items[i]) in wanted else len(wanted),
            i,
        ),
    )
    return [items[i] for i in ranked]
