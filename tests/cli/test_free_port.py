"""Ports for the local stack's children are picked where no outgoing connection can take them
between the pick and the child's bind (a loaded machine lost a stack that way), and never one
another live process of ours was handed (two suites at once lost a stack that way)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tessera_cli.nats_embedded import (
    LOW_PORT,
    ephemeral_range,
    free_port,
    port_reservations,
    reserve_port,
)


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


def test_a_port_another_live_process_was_handed_is_not_handed_out_again() -> None:
    """Another process picked ports (free still: it has not bound them yet); this one never gets
    them while it lives, and a dead process's reservations are taken over."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tessera_cli.nats_embedded import free_port;"
         "print(*[free_port() for _ in range(300)], flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        theirs = {int(p) for p in child.stdout.readline().split()}
        assert len(theirs) == 300
        for port in theirs:
            assert (port_reservations() / str(port)).read_text() == str(child.pid)
        mine = {free_port() for _ in range(300)}
        assert not mine & theirs
    finally:
        child.communicate("", timeout=30)
    port = min(theirs)  # the child ended: its port may be handed out again
    assert reserve_port(port)
    assert (port_reservations() / str(port)).read_text() == str(os.getpid())


def test_a_reservation_being_written_or_held_by_a_live_process_is_respected(
    tmp_path: Path,
) -> None:
    assert reserve_port(20001, tmp_path)
    assert (tmp_path / "20001").read_text() == str(os.getpid())
    assert not reserve_port(20001, tmp_path)  # this process's own: held while it lives
    (tmp_path / "20002").write_text("")  # a note another process is writing: held
    assert not reserve_port(20002, tmp_path)
    (tmp_path / "20003").write_text("999999999")  # no such process: taken over
    assert reserve_port(20003, tmp_path)
