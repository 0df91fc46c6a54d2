"""`tessera quota set|get|list` against a running quota service."""

from __future__ import annotations

import asyncio

import pytest
from quota_testkit import call, unique_namespace
from typer.testing import CliRunner

from tessera import bus
from tessera.models import QuotaAmount, QuotaRequest, QuotaStatusRequest
from tessera_cli.app import build_app
from tessera_cli.quota import QuotaCliError, parse_count_limit, parse_memory_limit


async def run_cli(*args: str) -> tuple[int, str]:
    """Run the CLI in a thread (it has its own event loop) while the service runs in ours."""
    result = await asyncio.to_thread(CliRunner().invoke, build_app(), list(args))
    return result.exit_code, result.output


async def test_set_get_list_show_limits_usage_and_pods(start_quota, nc, nats_url, monkeypatch):
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("COLUMNS", "200")
    await start_quota()
    ns = unique_namespace("cli")

    code, out = await run_cli(
        "quota", "set", ns, "--memory", "8Gi", "--cores", "200", "--gpus", "0"
    )
    assert code == 0, out
    assert "8,192 MiB" in out and "200%" in out and "0 (blocked)" in out
    status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert status.states[0].limits == QuotaAmount(memory_mib=8192, cores=200, gpus=0)

    code, out = await run_cli("quota", "set", ns, "--memory", "8000")
    assert code == 0, out
    assert (await call(nc, bus.QUOTA_RESERVE, QuotaRequest(
        namespace=ns, pod_uid="uid-1", name="trainer", memory_mib=6000, cores=50, gpus=2))).ok

    code, out = await run_cli("quota", "get", ns)
    assert code == 0, out
    assert "6,000 MiB" in out and "8,000 MiB" in out and "(75%)" in out
    assert "trainer" in out and "uid-1" in out and "unlimited" in out

    code, out = await run_cli("quota", "list")
    assert code == 0, out
    assert ns in out


async def test_cli_errors_are_readable(start_quota, nats_url, monkeypatch):
    monkeypatch.setenv("NATS_URL", nats_url)
    await start_quota()
    code, out = await run_cli("quota", "get", unique_namespace("nobody"))
    assert code == 1 and "unknown namespace" in out
    code, out = await run_cli("quota", "set", "Bad_Name", "--gpus", "1")
    assert code == 1 and "not a valid Kubernetes namespace" in out
    code, out = await run_cli("quota", "set", "team-a", "--memory", "-5")
    assert code == 1 and "negative" in out


def test_limit_parsing() -> None:
    assert parse_memory_limit("8000") == 8000
    assert parse_memory_limit("16Gi") == 16384
    assert parse_memory_limit("unlimited") is None
    assert parse_memory_limit(None) is None
    assert parse_memory_limit("0") == 0
    assert parse_count_limit("3", "--gpus") == 3
    for bad in ("1.5", "-1", "many"):
        with pytest.raises(QuotaCliError):
            parse_count_limit(bad, "--gpus")
