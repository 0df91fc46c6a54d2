"""The extender's HTTP face: kube-scheduler's JSON in, the engine's answers out.

Keys are matched case-insensitively, as kube-scheduler's Go decoder does. Malformed calls get a
4xx with a message; anything unexpected inside becomes an `error` in the result, never a 500.

A plain ASGI app (no framework routing or request objects: per call they cost more than the
placement): `Extender.respond(method, path, body)` answers a whole request, `__call__` is its
ASGI face for uvicorn and the tests' ASGI transport.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .engine import Scheduler
from .filtering import FilterOutcome
from .node_names import NodeNames, NodeNamesCache
from .node_reasons import NodeReasons, encode_compact
from .pod_gate import PodGate
from .pods import BadRequestError
from .validation import LedgerGuard

log = logging.getLogger("tessera.scheduler.api")
MAX_CANDIDATES = 100_000
_JSON = b"application/json"
_TEXT = b"text/plain; charset=utf-8"


class Reply(NamedTuple):
    status: int
    body: bytes
    content_type: bytes = _JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


def json_reply(value: Any, status: int = 200) -> Reply:
    """JSON as Starlette's JSONResponse wrote it (compact, UTF-8, no NaN)."""
    body = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Reply(status, body.encode())


NOT_FOUND = Reply(404, b"Not Found", _TEXT)


class _BadCall(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json_object(body: bytes, names: NodeNamesCache | None = None) -> dict[str, Any]:
    if names is not None:
        data = names.parse(body)
        if data is not None:
            return data
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise _BadCall(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _BadCall(400, "body must be a JSON object")
    return {str(k).lower(): v for k, v in data.items()}


def _extender_args(data: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[Any] | None]:
    """(pod, candidate names, full node objects or None) from ExtenderArgs."""
    pod = data.get("pod")
    if not isinstance(pod, dict):
        raise _BadCall(400, "ExtenderArgs.pod must be a Pod object")
    names = data.get("nodenames")
    nodes = data.get("nodes")
    if names is not None:
        if isinstance(names, NodeNames):
            return pod, names, None  # checked when its bytes were first parsed
        if not isinstance(names, list) or not set(map(type, names)) <= {str}:
            raise _BadCall(400, "ExtenderArgs.nodenames must be a list of strings")
        if len(names) > MAX_CANDIDATES:
            raise _BadCall(413, f"more than {MAX_CANDIDATES} candidate nodes")
        return pod, names, None
    if nodes is not None:
        items = nodes.get("items") if isinstance(nodes, dict) else None
        if items is None and isinstance(nodes, dict):
            items = []
        if not isinstance(items, list):
            raise _BadCall(400, "ExtenderArgs.nodes must be a NodeList")
        node_names: list[str] = []
        for item in items:
            meta = item.get("metadata") if isinstance(item, dict) else None
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str) or not name:
                raise _BadCall(400, "every node in ExtenderArgs.nodes needs metadata.name")
            node_names.append(name)
        return pod, node_names, items
    raise _BadCall(400, "ExtenderArgs needs nodenames or nodes")


def _filter_result(outcome: FilterOutcome, nodes: list[Any] | None) -> dict[str, Any]:
    failed, unresolvable = outcome.failed, outcome.unresolvable
    result: dict[str, Any] = {
        "failedNodes": failed.as_dict() if isinstance(failed, NodeReasons) else failed,
        "failedAndUnresolvableNodes": (unresolvable.as_dict()
                                       if isinstance(unresolvable, NodeReasons) else unresolvable),
        "error": outcome.error,
    }
    passed = outcome.nodenames or []
    if nodes is None:
        result["nodenames"] = passed
    else:
        keep = set(passed)
        items = [n for n in nodes if n["metadata"]["name"] in keep]
        result["nodes"] = {"apiVersion": "v1", "kind": "NodeList", "items": items}
    return result


def _filter_reply(outcome: FilterOutcome) -> bytes:
    """`json_reply(_filter_result(outcome, None))`'s body, the refusals' maps written by
    `NodeReasons.to_json` (no dict of every node built) and the rest by msgspec."""

    def written(reasons: dict[str, str] | NodeReasons) -> bytes:
        return reasons.to_json() if isinstance(reasons, NodeReasons) else encode_compact(reasons)

    # (one join: each `+` copied the whole reply again, ~0.8 MB at 20,000 refused nodes)
    return b"".join((b'{"failedNodes":', written(outcome.failed),
                     b',"failedAndUnresolvableNodes":', written(outcome.unresolvable),
                     b',"error":', encode_compact(outcome.error),
                     b',"nodenames":', encode_compact(list(outcome.nodenames or [])), b"}"))


Handler = Callable[[bytes], Awaitable[Reply]]


class Extender:
    """The extender's routes (see `build_app`), answering whole requests."""

    def __init__(
        self,
        scheduler: Scheduler,
        ready: Callable[[], bool],
        max_body_bytes: int,
        refusing: Callable[[], str] | None,
        guard: LedgerGuard | None,
        gate: PodGate | None,
        probes_only: bool,
    ) -> None:
        self.scheduler = scheduler
        self.metrics = scheduler.metrics
        self.ready = ready
        self.max_body_bytes = max_body_bytes
        self.refusing = refusing
        self.guard = guard
        self.gate = gate
        # a list kube-scheduler has not sent before is resolved from its bytes where it can be
        self.names_cache = NodeNamesCache(
            MAX_CANDIDATES, resolver=scheduler.index.names_from_bytes,
            runs=scheduler.index.names_of_run, in_place=scheduler.index.names_in_body,
        )
        probes: dict[str, tuple[str, Handler]] = {
            "/healthz": ("GET", self.healthz),
            "/readyz": ("GET", self.readyz),
            "/metrics": ("GET", self.metrics_page),
        }
        calls: dict[str, tuple[str, Handler]] = {
            "/filter": ("POST", self.filter_),
            "/prioritize": ("POST", self.prioritize),
            "/bind": ("POST", self.bind),
        }
        self.routes = probes if probes_only else {**calls, **probes}

    # --- HTTP ---------------------------------------------------------------------------------
    def route(self, method: str, path: str) -> Handler | Reply:
        """The handler for a call, or the reply refusing it (404, 405)."""
        found = self.routes.get(path)
        if found is None:
            return NOT_FOUND
        allowed, handler = found
        if method == allowed or (allowed == "GET" and method == "HEAD"):
            return handler
        allow = b"GET, HEAD" if allowed == "GET" else allowed.encode()
        return Reply(405, b"Method Not Allowed", _TEXT, ((b"allow", allow),))

    def too_large(self) -> Reply:
        return json_reply({"error": f"request body larger than {self.max_body_bytes} bytes"}, 413)

    async def respond(self, method: str, path: str, body: bytes) -> Reply:
        """One whole request (the body already read, within max_body_bytes)."""
        handler = self.route(method, path)
        if isinstance(handler, Reply):
            return handler
        return await handler(body)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """ASGI."""
        kind = scope["type"]
        if kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if kind != "http":
            return
        handler = self.route(scope["method"], scope["path"])
        if isinstance(handler, Reply):
            reply = handler
        else:
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client went away
            reply = self.too_large() if isinstance(body, Reply) else await handler(body)
        headers = [
            (b"content-length", str(len(reply.body)).encode()),
            (b"content-type", reply.content_type),
            *reply.headers,
        ]
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body})

    async def _read_body(self, scope: dict[str, Any], receive: Any) -> bytes | Reply | None:
        """The body, or a Reply when it is over the limit, or None on disconnect."""
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    return self.too_large()
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    return self.too_large()
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # --- the calls ----------------------------------------------------------------------------
    async def filter_(self, body: bytes) -> Reply:
        started = time.perf_counter()
        metrics, scheduler, refusing, guard = (self.metrics, self.scheduler, self.refusing,
                                               self.guard)  # fmt: skip
        nodes: list[Any] | None = None
        try:
            data = _json_object(body, self.names_cache)
            pod, names, nodes = _extender_args(data)
            if nodes is not None:
                scheduler.learn_node_objects(nodes)
            wait = refusing() if refusing is not None else ""
            if wait:
                outcome = FilterOutcome(error=wait)
            else:
                refused = guard.refusals(names) if guard is not None else {}
                if refused:
                    names = [n for n in names if n not in refused]
                outcome = await scheduler.filter(pod, names, dry_run=nodes is not None)
                outcome.failed.update(refused)
        except _BadCall as exc:
            return json_reply({"error": str(exc)}, exc.status)
        except BadRequestError as exc:
            return json_reply({"error": str(exc)}, 400)
        except Exception as exc:
            log.exception("filter failed")
            outcome = FilterOutcome(error=f"internal error: {type(exc).__name__}: {exc}")
        finally:
            metrics.filter_seconds.observe(time.perf_counter() - started)
        fits = bool(outcome.nodenames) or outcome.passed_all
        metrics.filtered(time.perf_counter() - started, fits and not outcome.error)
        if nodes is None:  # names and texts only: json.dumps' bytes, written ~10x faster
            return Reply(200, _filter_reply(outcome))
        return json_reply(_filter_result(outcome, nodes))

    async def prioritize(self, body: bytes) -> Reply:
        try:
            data = _json_object(body)
            pod, names, _nodes = _extender_args(data)
            return json_reply(self.scheduler.prioritize(pod, names))
        except _BadCall as exc:
            return json_reply({"error": str(exc)}, exc.status)
        except BadRequestError as exc:
            return json_reply({"error": str(exc)}, 400)
        except Exception as exc:
            log.exception("prioritize failed")
            return json_reply({"error": f"internal error: {exc}"}, 422)

    async def bind(self, body: bytes) -> Reply:
        started = time.perf_counter()
        metrics, refusing, guard, gate = self.metrics, self.refusing, self.guard, self.gate
        try:
            data = _json_object(body)
            fields = {}
            for key in ("podname", "podnamespace", "poduid", "node"):
                value = data.get(key, "")
                if not isinstance(value, str):
                    raise _BadCall(400, f"ExtenderBindingArgs.{key} must be a string")
                fields[key] = value
            if not fields["podname"] or not fields["node"]:
                raise _BadCall(400, "ExtenderBindingArgs needs PodName and Node")
            namespace = fields["podnamespace"] or "default"
            error = refusing() if refusing is not None else ""
            if not error and guard is not None:
                error = guard.refusal(fields["node"]) or ""
            if not error and gate is not None:
                error = await gate.check_bind(
                    namespace, fields["podname"], fields["poduid"], fields["node"]
                ) or ""
            if error:
                log.warning("bind refused", extra={"node": fields["node"], "reason": error})
                metrics.bind_errors.inc()
                return json_reply({"Error": error})
            error = await self.scheduler.bind(
                namespace, fields["podname"], fields["poduid"], fields["node"]
            )
        except _BadCall as exc:
            return json_reply({"Error": str(exc)}, exc.status)
        except Exception as exc:
            log.exception("bind failed")
            error = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            metrics.bind_seconds.observe(time.perf_counter() - started)
        if error:
            metrics.bind_errors.inc()
        metrics.bound_result(not error)
        return json_reply({"Error": error})

    async def healthz(self, body: bytes) -> Reply:
        return json_reply({"ok": True})

    async def readyz(self, body: bytes) -> Reply:
        ok = self.ready()
        return json_reply({"ready": ok}, 200 if ok else 503)

    async def metrics_page(self, body: bytes) -> Reply:
        scheduler = self.scheduler
        self.metrics.inflight_claims.set(scheduler.index.claims_held(scheduler.clock()))
        self.metrics.nodes.set(sum(1 for e in scheduler.index.entries.values() if e.schedulable))
        return Reply(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode())


def build_app(
    scheduler: Scheduler,
    ready: Callable[[], bool],
    max_body_bytes: int = 32 * 1024 * 1024,
    *,
    refusing: Callable[[], str] | None = None,
    guard: LedgerGuard | None = None,
    gate: PodGate | None = None,
    probes_only: bool = False,
) -> Extender:
    """The extender's routes. `refusing()` names why filters and binds must wait ('' = serve):
    until the ledger is synced and rebuilt from the cluster, no placement may be made on what it
    does not know. `guard` refuses nodes whose ledger entry is quarantined; `gate` checks with
    the cluster that the pod's node constraints allow the node before bind (filter asks it
    whether the pod exists through `PodFilter.pod_check`). `probes_only`: only /healthz, /readyz
    and /metrics (the plain listener beside an mTLS extender)."""
    return Extender(scheduler, ready, max_body_bytes, refusing, guard, gate, probes_only)
