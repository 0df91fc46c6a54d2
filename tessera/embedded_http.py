"""uvicorn inside a service or a test's event loop, without uvicorn's own signal handling.

uvicorn's `serve()` replaces the SIGINT/SIGTERM handlers while it runs and puts back, when it
stops, whatever it found when it started. Embedded in a process that owns its signals (a service
stops on its stop event; pytest-asyncio's runner installs and removes its own SIGINT handler around
each fixture), that put-back restores a handler which is no longer current: a stale handler is left
installed for the rest of the process. Whoever embeds uvicorn rules shutdown through
`should_exit`, so uvicorn touches no signal at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn


class EmbeddedUvicorn(uvicorn.Server):
    """`uvicorn.Server` that leaves the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn before 0.29 called this instead
        return None
