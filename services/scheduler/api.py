"""The extender's HTTP face: kube-scheduler's JSON in, the engine's answers out.

Keys are matched case-insensitively, as kube-scheduler's Go decoder does. Malformed calls get a
4xx with a message; anything unexpected inside becomes an `error` in the result, never a 500.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .engine import Scheduler
from .filtering import FilterOutcome
from .node_names import NodeNames, NodeNamesCache
from .pod_gate import PodGate
from .pods import BadRequestError
from .validation import LedgerGuard

log = logging.getLogger("tessera.scheduler.api")
MAX_CANDIDATES = 100_000


class _BadCall(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _json_object(
    request: Request, max_bytes: int, names: NodeNamesCache | None = None
) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise _BadCall(413, f"request body larger than {max_bytes} bytes")
    body = await request.body()
    if len(body) > max_bytes:
        raise _BadCall(413, f"request body larger than {max_bytes} bytes")
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
    result: dict[str, Any] = {
        "failedNodes": outcome.failed,
        "failedAndUnresolvableNodes": outcome.unresolvable,
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


def build_app(
    scheduler: Scheduler,
    ready: Callable[[], bool],
    max_body_bytes: int = 32 * 1024 * 1024,
    *,
    refusing: Callable[[], str] | None = None,
    guard: LedgerGuard | None = None,
    gate: PodGate | None = None,
    probes_only: bool = False,
) -> Starlette:
    """The extender's routes. `refusing()` names why filters and binds must wait ('' = serve):
    until the ledger is synced and rebuilt from the cluster, no placement may be made on what it
    does not know. `guard` refuses nodes whose ledger entry is quarantined; `gate` checks with
    the cluster that the pod's node constraints allow the node before bind (filter asks it
    whether the pod exists through `PodFilter.pod_check`). `probes_only`: only /healthz, /readyz
    and /metrics (the plain listener beside an mTLS extender)."""
    metrics = scheduler.metrics
    names_cache = NodeNamesCache(MAX_CANDIDATES)

    async def filter_(request: Request) -> Response:
        started = time.perf_counter()
        nodes: list[Any] | None = None
        try:
            data = await _json_object(request, max_body_bytes, names_cache)
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
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        except BadRequestError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except Exception as exc:
            log.exception("filter failed")
            outcome = FilterOutcome(error=f"internal error: {type(exc).__name__}: {exc}")
        finally:
            metrics.filter_seconds.observe(time.perf_counter() - started)
        fits = bool(outcome.nodenames) or outcome.passed_all
        metrics.filtered(time.perf_counter() - started, fits and not outcome.error)
        return JSONResponse(_filter_result(outcome, nodes))

    async def prioritize(request: Request) -> Response:
        try:
            data = await _json_object(request, max_body_bytes)
            pod, names, _nodes = _extender_args(data)
            return JSONResponse(scheduler.prioritize(pod, names))
        except _BadCall as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        except BadRequestError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except Exception as exc:
            log.exception("prioritize failed")
            return JSONResponse({"error": f"internal error: {exc}"}, status_code=422)

    async def bind(request: Request) -> Response:
        started = time.perf_counter()
        try:
            data = await _json_object(request, max_body_bytes)
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
                return JSONResponse({"Error": error})
            error = await scheduler.bind(
                fields["podnamespace"] or "default",
                fields["podname"],
                fields["poduid"],
                fields["node"],
            )
        except _BadCall as exc:
            return JSONResponse({"Error": str(exc)}, status_code=exc.status)
        except Exception as exc:
            log.exception("bind failed")
            error = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            metrics.bind_seconds.observe(time.perf_counter() - started)
        if error:
            metrics.bind_errors.inc()
        metrics.bound_result(not error)
        return JSONResponse({"Error": error})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(request: Request) -> Response:
        ok = ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metrics_page(request: Request) -> Response:
        metrics.inflight_claims.set(scheduler.index.claims_held(scheduler.clock()))
        metrics.nodes.set(sum(1 for e in scheduler.index.entries.values() if e.schedulable))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    probes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]
    if probes_only:
        return Starlette(routes=probes)
    return Starlette(
        routes=[
            Route("/filter", filter_, methods=["POST"]),
            Route("/prioritize", prioritize, methods=["POST"]),
            Route("/bind", bind, methods=["POST"]),
            *probes,
        ]
    )
