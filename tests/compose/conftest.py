"""The image, built once per session for the tests that run it (container_engine.py)."""

from __future__ import annotations

import pytest
from container_engine import IMAGE, build_image, engine_or_skip


@pytest.fixture(scope="session")
def image() -> str:
    engine_or_skip()
    seconds = build_image()
    print(f"make image: {seconds:.0f} s")
    return IMAGE
