"""CPU kube-sim spends per outgoing call (webhook review, extender filter/bind): httpx's
AsyncClient (what kube-sim used) against kube-sim's own client (services/kube-sim/http_client.py),
same server, same bodies, alternating rounds.

The server is a separate process (uvicorn, as the admission webhook runs, answering each POST
with a review-sized JSON reply), so the CPU measured (`time.process_time` of this process) is
the client's alone: building the request, the connection pool, parsing the reply. Each round
sends `BENCH_CALLS` POSTs of a pod-sized AdmissionReview, `BENCH_CONCURRENCY` at a time (the
burst's 16 concurrent creates keep that many connections open). The figure is steadier than
wall-clock on a shared machine; the load average is recorded with it.

    python bench/kube_sim_client.py     # prints; BENCH_NO_RECORD=1 to leave RESULTS.md alone
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

CALLS = int(os.environ.get("BENCH_CALLS", "1000"))
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "16"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))

SERVER = """
import json, sys, uvicorn
REPLY = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                    "response": {"uid": "u", "allowed": True, "patch": "x" * 600}}).encode()
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(REPLY)).encode())]})
    await send({"type": "http.response.body", "body": REPLY})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            loop="uvloop", http="httptools")
"""


def review_body() -> dict:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "burst-1", "namespace": "default", "uid": "x" * 36,
                        "labels": {"burst": "b0"}, "annotations": {}},
           "spec": {"containers": [{"name": "main", "image": "cuda:12", "resources": {
               "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2k"}}}],
               "schedulerName": "default-scheduler"},
           "status": {"phase": "Pending", "qosClass": "BestEffort"}}  # fmt: skip
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u", "operation": "CREATE", "object": pod, "oldObject": None,
                        "userInfo": {"username": "kube-sim-admin"}}}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_round(kind: str, url: str) -> float:
    """CPU seconds of this process per call."""
    import httpx
    from tessera.kube_sim.http_client import JsonPoster

    body = review_body()
    if kind == "httpx":
        client = httpx.AsyncClient(timeout=10.0)

        async def post() -> None:
            reply = await client.post(url, json=body)
            assert reply.status_code == 200
            reply.json()

        close = client.aclose
    else:
        poster = JsonPoster(url, None, 10.0)

        async def post() -> None:
            reply = await poster.post("", body)
            assert reply.status == 200
            reply.json()

        close = poster.close
    queue = list(range(CALLS))

    async def worker() -> None:
        while queue:
            queue.pop()
            await post()

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))  # warm: connections open
    queue = list(range(CALLS))
    started = time.process_time()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    spent = time.process_time() - started
    await close()
    return spent / CALLS


def main() -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}/mutate"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        load_before = os.getloadavg()[0]
        per_call: dict[str, list[float]] = {"httpx": [], "kube-sim client": []}
        for _ in range(ROUNDS):
            for kind in per_call:
                per_call[kind].append(asyncio.run(one_round(kind, url)))
        load_after = os.getloadavg()[0]
    finally:
        server.terminate()
        server.wait(10)
    lines = [
        f"{CALLS} POSTs of a pod's AdmissionReview ({len(json.dumps(review_body()))} bytes) per "
        f"round, {CONCURRENCY} at a time, to a uvicorn server in another process (plain HTTP: "
        "TLS costs both clients the same); client CPU per call (process time), rounds "
        f"alternating; load {load_before:.1f} → {load_after:.1f}.",
        "",
        "| client | µs CPU per call (each round) | median |",
        "|---|---|---:|",
    ]
    for kind, values in per_call.items():
        runs = ", ".join(f"{v * 1e6:.0f}" for v in values)
        lines.append(f"| {kind} | {runs} | {statistics.median(values) * 1e6:.0f} |")
    text = "\n".join(lines)
    print(text)
    if not os.environ.get("BENCH_NO_RECORD"):
        from record import record_section

        record_section("kube-sim's outgoing calls", text)


if __name__ == "__main__":
    main()
