"""Label and field selectors as kube-apiserver parses them.

Labels: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a` (exists), `!a` (absent), and a
`metav1.LabelSelector` (`matchLabels` + `matchExpressions`) as workloads carry it.
Fields: `path=value`, `path==value`, `path!=value` on any dotted path of the object
(`metadata.name`, `spec.nodeName`, `status.phase`, `involvedObject.uid`, ...); `source` on events
is `source.component`, as kube-apiserver maps it. Pure functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector kube-apiserver would refuse (400 BadRequest)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, found: str | None) -> bool:
        if self.operator == "exists":
            return found is not None
        if self.operator == "!":
            return found is None
        if self.operator in ("=", "in"):
            return found is not None and found in self.values
        # != and notin match objects without the key, as Kubernetes does
        return found is None or found not in self.values


_SET_TERM = re.compile(r"^\s*([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    terms, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


def parse_labels(text: str | None) -> tuple[Requirement, ...]:
    requirements: list[Requirement] = []
    for term in _split_terms(text or ""):
        set_match = _SET_TERM.match(term)
        if set_match:
            values = tuple(v.strip() for v in set_match.group(3).split(",") if v.strip())
            requirements.append(Requirement(set_match.group(1), set_match.group(2), values))
            continue
        for operator in ("!=", "==", "="):
            if operator in term:
                key, _, value = term.partition(operator)
                key, value = key.strip(), value.strip()
                if not key or any(c in key for c in " ()!="):
                    raise SelectorError(f'unable to parse requirement: "{term}"')
                requirements.append(Requirement(key, "!=" if operator == "!=" else "=", (value,)))
                break
        else:
            if term.startswith("!"):
                requirements.append(Requirement(term[1:].strip(), "!"))
            elif re.fullmatch(r"[A-Za-z0-9._/-]+", term):
                requirements.append(Requirement(term, "exists"))
            else:
                raise SelectorError(f'unable to parse requirement: "{term}"')
    return tuple(requirements)


def parse_fields(text: str | None) -> tuple[Requirement, ...]:
    requirements: list[Requirement] = []
    for term in _split_terms(text or ""):
        for operator in ("!=", "==", "="):
            if operator in term:
                key, _, value = term.partition(operator)
                requirements.append(
                    Requirement(key.strip(), "!=" if operator == "!=" else "=", (value.strip(),))
                )
                break
        else:
            raise SelectorError(f'invalid selector: \'{term}\'; can\'t understand \'{term}\'')
    return tuple(requirements)


def from_label_selector(selector: dict[str, Any] | None) -> tuple[Requirement, ...]:
    """A `metav1.LabelSelector` (matchLabels, matchExpressions) as requirements."""
    selector = selector or {}
    found = [Requirement(k, "=", (str(v),)) for k, v in (selector.get("matchLabels") or {}).items()]
    operators = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expression in selector.get("matchExpressions") or []:
        operator = operators.get(expression.get("operator", ""))
        if operator is None:
            raise SelectorError(f"{expression.get('operator')!r} is not a valid label selector "
                                "operator")
        values = tuple(str(v) for v in expression.get("values") or [])
        found.append(Requirement(str(expression.get("key", "")), operator, values))
    return tuple(found)


def labels_match(requirements: tuple[Requirement, ...], labels: dict[str, Any] | None) -> bool:
    labels = labels or {}
    return all(r.matches(None if r.key not in labels else str(labels[r.key]))
               for r in requirements)


def field_value(obj: dict[str, Any], path: str) -> str | None:
    if path == "source":
        path = "source.component"
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, dict):
            return None
        current = current.get(part)
    if current is None:
        # kube-apiserver indexes an absent string field as "" (spec.nodeName= selects unbound)
        return ""
    if isinstance(current, bool):
        return "true" if current else "false"
    return str(current)


def fields_match(requirements: tuple[Requirement, ...], obj: dict[str, Any]) -> bool:
    return all(r.matches(field_value(obj, r.key)) for r in requirements)
