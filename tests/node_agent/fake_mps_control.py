#!/usr/bin/env -S python3 -S
"""FAKE nvidia-cuda-mps-control: a test stand-in for NVIDIA's MPS control daemon (no GPU here).

It follows the documented contract of the real program (NVIDIA's MPS documentation, the
nvidia-cuda-mps-control(1) man page), not its implementation:

- `-d` starts the daemon in the background (`-f`: in the foreground). It uses
  `CUDA_MPS_PIPE_DIRECTORY` (default /tmp/nvidia-mps) and `CUDA_MPS_LOG_DIRECTORY` (default
  /var/log/nvidia-mps), writes `nvidia-cuda-mps-control.pid` into the pipe directory and logs
  every command it receives to `control.log` in the log directory (`[time] Cmd: <command>`).
  A second `-d` on a pipe directory whose daemon answers fails ("An instance of this daemon is
  already running").
- Without `-d`/`-f` it is the interactive client: one command per line on stdin, the daemon's
  answer on stdout; exit status 1 when no daemon answers on the pipe directory.
- Commands: `get_server_list`, `start_server -uid <uid>`, `get_client_list <PID>`, `quit`,
  `set_default_active_thread_percentage <pct>` / `get_default_active_thread_percentage`,
  `set_active_thread_percentage <PID> <pct>` / `get_active_thread_percentage <PID>`,
  `set_default_device_pinned_mem_limit <dev> <value>` / `get_default_device_pinned_mem_limit
  <dev>`, `set_device_pinned_mem_limit <PID> <dev> <value>` / `get_device_pinned_mem_limit
  <PID> <dev>` (values like `2048M`, `2G`). Defaults apply to servers started afterwards; a
  server's own setting applies to clients that connect to it afterwards (as documented).
- Servers are real (sleeping) child processes with real PIDs, one uid at a time: a client of
  another uid is refused while the running server still has clients. Limits live per server.
- Several daemons run side by side, each on its own pipe directory with its own servers and
  limits (NVIDIA's "multiple control/server pairs"); a client reaches only the daemon of the
  pipe directory it is given.

What the fake CUDA driver (tests/native/fakes/fake_mps.c) speaks to it, in place of the private
client protocol of the real driver: `fake_client_attach <pid> <uid>` → `<limit bytes of device
0 or 0> <active thread %>` (the limits the client's server gives it, fixed at connection time),
or `ERR <text>`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def dirs() -> tuple[str, str]:
    return (os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps",
            os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")


def parse_size(text: str) -> int | None:
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    return int(m.group(1)) * UNITS[m.group(2)] if m else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Daemon:
    def __init__(self, pipe: str, logdir: str) -> None:
        self.pipe = pipe
        self.logdir = logdir
        self.default_atp = 100.0
        self.default_mem: dict[int, int] = {}
        self.servers: dict[int, dict] = {}  # pid -> {uid, atp, mem, clients: {pid: limits}}
        self.running = True

    def log(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(os.path.join(self.logdir, "control.log"), "a") as f:
            f.write(f"[{stamp}] {text}\n")

    def reap(self) -> None:
        for pid in list(self.servers):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not alive(pid):
                del self.servers[pid]
                continue
            clients = self.servers[pid]["clients"]
            for c in [c for c in clients if not alive(c)]:
                del clients[c]

    def start_server(self, uid: int) -> int:
        pid = os.fork()
        if pid == 0:  # the fake server: a process that lives until told to go
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(3600)
        self.servers[pid] = {"uid": uid, "atp": self.default_atp,
                             "mem": dict(self.default_mem), "clients": {}}
        self.log(f"Server {pid} (uid {uid}) started")
        return pid

    def stop_server(self, pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        self.servers.pop(pid, None)
        self.log(f"Server {pid} exited")

    def server(self, text: str) -> dict | None:
        try:
            return self.servers.get(int(text))
        except ValueError:
            return None

    def handle(self, line: str) -> str:
        self.reap()
        self.log(f"Cmd: {line}")
        words = line.split()
        if not words:
            return ""
        cmd, args = words[0], words[1:]
        if cmd == "get_server_list":
            return "\n".join(str(p) for p in self.servers)
        if cmd == "start_server" and len(args) == 2 and args[0] == "-uid" and args[1].isdigit():
            uid = int(args[1])
            if any(s["uid"] == uid for s in self.servers.values()):
                return ""
            if not self.servers:  # another user's server: the real one queues the request
                self.start_server(uid)
            return ""
        if cmd == "get_client_list" and len(args) == 1:
            s = self.server(args[0])
            return "\n".join(str(c) for c in s["clients"]) if s else ""
        if cmd == "quit":
            self.running = False
            return ""
        if cmd == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                pct = float(args[0])
            except ValueError:
                return "Invalid percentage"
            if not 0 < pct <= 100:
                return "Invalid percentage"
            self.default_atp = pct
            return f"{pct:.1f}"
        if cmd == "get_default_active_thread_percentage":
            return f"{self.default_atp:.1f}"
        if cmd == "set_active_thread_percentage" and len(args) == 2:
            s = self.server(args[0])
            try:
                pct = float(args[1])
            except ValueError:
                return "Invalid percentage"
            if s is None:
                return f"Server {args[0]} not found"
            if not 0 < pct <= 100:
                return "Invalid percentage"
            s["atp"] = pct
            return f"{pct:.1f}"
        if cmd == "get_active_thread_percentage" and len(args) == 1:
            s = self.server(args[0])
            return f"{s['atp']:.1f}" if s else f"Server {args[0]} not found"
        if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
            size = parse_size(args[1])
            if size is None or not args[0].isdigit():
                return "Invalid device memory limit"
            self.default_mem[int(args[0])] = size
            return ""
        if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
            size = self.default_mem.get(int(args[0])) if args[0].isdigit() else None
            return f"{size >> 20}M" if size else "0"
        if cmd == "set_device_pinned_mem_limit" and len(args) == 3:
            s = self.server(args[0])
            size = parse_size(args[2])
            if s is None:
                return f"Server {args[0]} not found"
            if size is None or not args[1].isdigit():
                return "Invalid device memory limit"
            s["mem"][int(args[1])] = size
            return ""
        if cmd == "get_device_pinned_mem_limit" and len(args) == 2:
            s = self.server(args[0])
            if s is None:
                return f"Server {args[0]} not found"
            size = s["mem"].get(int(args[1])) if args[1].isdigit() else None
            return f"{size >> 20}M" if size else "0"
        if cmd == "fake_client_attach" and len(args) == 2:
            return self.attach(int(args[0]), int(args[1]))
        return f"Unknown command: {line}"

    def attach(self, pid: int, uid: int) -> str:
        """A client connects: the server of its uid (started with the defaults if none runs)."""
        mine = [p for p, s in self.servers.items() if s["uid"] == uid]
        if mine:
            server = mine[0]
        elif any(s["clients"] for s in self.servers.values()):
            return "ERR a server of another user is busy"
        else:
            for p in list(self.servers):
                self.stop_server(p)
            server = self.start_server(uid)
        s = self.servers[server]
        limits = (s["mem"].get(0, 0), s["atp"])
        s["clients"][pid] = limits
        self.log(f"New client {pid} (uid {uid}) connected to server {server}: pinned device "
                 f"memory limit {limits[0]} bytes, active thread percentage {limits[1]:.1f}")
        return f"{limits[0]} {limits[1]:.1f}"

    def serve(self) -> None:
        path = os.path.join(self.pipe, SOCKET)
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(16)
        sock.settimeout(0.5)
        # SIGTERM: shut down as `quit` does (servers ended, pipe directory cleaned).
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "running", False))
        tmp = os.path.join(self.pipe, PID_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, os.path.join(self.pipe, PID_FILE))
        self.log("Startup")
        while self.running:
            try:
                conn, _ = sock.accept()
            except (TimeoutError, InterruptedError):
                self.reap()
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while not data.endswith(b"\n"):
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    for line in data.decode(errors="replace").splitlines():
                        conn.sendall((self.handle(line.strip()) + "\n\0").encode())
                except OSError:
                    pass
        for pid in list(self.servers):
            self.stop_server(pid)
        self.log("Shutdown")
        sock.close()
        for name in (SOCKET, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.pipe, name))


def talk(pipe: str, line: str) -> str | None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(os.path.join(pipe, SOCKET))
            s.sendall(line.encode() + b"\n")
            data = b""
            while not data.endswith(b"\0"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data.rstrip(b"\0").decode().rstrip("\n")
    except OSError:
        return None


def main(argv: list[str]) -> int:
    pipe, logdir = dirs()
    if argv and argv[0] in ("-d", "-f"):
        if talk(pipe, "get_server_list") is not None:
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        os.makedirs(pipe, exist_ok=True)
        os.makedirs(logdir, exist_ok=True)
        if argv[0] == "-d":
            if os.fork() > 0:
                # the parent returns once the daemon answers, as the real -d does
                for _ in range(200):
                    if talk(pipe, "get_server_list") is not None:
                        return 0
                    time.sleep(0.025)
                return 1
            os.setsid()
            if os.fork() > 0:
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDWR)
            errors = os.open(os.path.join(logdir, "fake-daemon.err"),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            for fd, to in ((0, devnull), (1, devnull), (2, errors)):
                os.dup2(to, fd)
        Daemon(pipe, logdir).serve()
        return 0
    if argv:
        print(f"Unknown option {argv[0]}", file=sys.stderr)
        return 1
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        answer = talk(pipe, line)
        if answer is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        if answer:
            print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
