"""Placeholder: replaced below once the stand-in kubelet lands."""

from __future__ import annotations


async def start_kubelets(sim: object) -> list:  # type: ignore[type-arg]
    return []
