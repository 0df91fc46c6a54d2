"""Every pod annotation a device family reads or writes (its selection knobs, its grant records
and the extras its vendor's tools read), so admission does not call them misspelt. Pure."""

from __future__ import annotations

from functools import lru_cache

from . import registry


def family_annotation_keys() -> frozenset[str]:
    """The keys of the families registered now (a family registered or unregistered later, as
    tests and plugins do, changes them)."""
    return _keys(registry.version)


@lru_cache(maxsize=4)
def _keys(_version: int) -> frozenset[str]:
    keys: set[str] = set()
    for family in registry.families():
        keys.update(family.selection_annotations())
        keys.update(k for k in (family.to_allocate_annotation, family.allocated_annotation) if k)
        keys.update(getattr(family, "extra_annotations", ()))
    return frozenset(keys)
