"""`python -m tessera.admission`: mutating admission webhook (HAMi rules)."""

import asyncio

import uvloop

from tessera.service import run_service

from .service import run_admission


def main() -> None:
    # uvloop roughly halves the per-request overhead of the event loop.
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    run_service("admission", "mutating admission webhook (HAMi rules)", run_admission)


if __name__ == "__main__":
    main()
