"""Ports for the local stack's children are picked where no outgoing connection can take them
between the pick and the child's bind (a loaded machine lost a stack that way)."""

from __future__ import annotations

import socket

from tessera_cli.nats_embedded import LOW_PORT, ephemeral_range, free_port


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_bind() -> None:
    low, high = ephemeral_range()
    assert LOW_PORT < low <= high
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # random picks, not one port handed out again and again
    for port in ports:
        assert LOW_PORT <= port < low
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", min(ports)))  # free when handed out


def test_a_port_in_use_is_never_handed_out() -> None:
    """Hold listeners on many ports of the range: none of them comes back."""
    held = []
    try:
        for _ in range(200):
            sock = socket.socket()
            sock.bind(("127.0.0.1", free_port()))
            sock.listen()
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == len(held)
        assert not taken & {free_port() for _ in range(100)}
    finally:
        for sock in held:
            sock.close()
