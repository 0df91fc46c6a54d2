"""Issue 34 in the charts: every service with a userPassword identity gets the command trust
file and its own signing key; the metrics dashboard can require a token behind its Service."""

from __future__ import annotations

from test_charts import SERVICE_CHARTS, charts_dir, render  # noqa: F401 - the fixture

AUTH = {"nats": {"url": "nats://nats:4222", "auth": {"type": "userPassword"}}}


def service_env(spec: dict) -> list[dict]:
    """The env of the Tessera container (the scheduler's pod also runs kube-scheduler)."""
    return next(c["env"] for c in spec["containers"]
                if any(e["name"] == "NATS_URL" for e in c.get("env", [])))


def pod_spec(manifests: list) -> dict:
    workload = next(m for m in manifests if m["kind"] in ("Deployment", "DaemonSet"))
    return workload["spec"]["template"]["spec"]


def test_every_service_reads_its_own_key_and_the_trust_file(charts_dir) -> None:  # noqa: F811
    for chart in SERVICE_CHARTS:
        spec = pod_spec(render(charts_dir, chart, AUTH))
        env = {e["name"]: e.get("value") for e in service_env(spec)}
        assert env["TESSERA_COMMAND_TRUST_FILE"] == "/etc/tessera/command-trust/trust.json"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["command-trust"]["secret"]["secretName"] == "tessera-command-trust"
        if chart == "tessera-node-agent":  # the node's own host directory, beside its password
            assert env["TESSERA_COMMAND_KEY_FILE"] == "/etc/tessera/nats/command.key"
            assert "command-key" not in volumes
        else:
            component = chart.removeprefix("tessera-")
            assert env["TESSERA_COMMAND_KEY_FILE"] == "/etc/tessera/command-key/command-key"
            secret = volumes["command-key"]["secret"]
            assert secret["secretName"] == f"tessera-nats-{component}"
            assert secret["items"] == [{"key": "command-key", "path": "command-key"}]
        off = {"nats": {**AUTH["nats"], "auth": {"type": "userPassword",
                                                 "commandSigning": False}}}  # fmt: skip
        env_off = {e["name"] for e in service_env(pod_spec(render(charts_dir, chart, off)))}
        assert "TESSERA_COMMAND_KEY_FILE" not in env_off


def test_the_dashboard_token_is_mounted_and_scraped_with(charts_dir) -> None:  # noqa: F811
    values = {**AUTH, "auth": {"existingSecret": "dash-token"},
              "serviceMonitor": {"enabled": True}}  # fmt: skip
    manifests = render(charts_dir, "tessera-metrics", values)
    spec = pod_spec(manifests)
    env = {e["name"]: e.get("value") for e in service_env(spec)}
    assert env["TESSERA_METRICS_AUTH_TOKEN_FILE"] == "/etc/tessera/metrics-auth/token"
    volume = next(v for v in spec["volumes"] if v["name"] == "metrics-auth")
    assert volume["secret"]["secretName"] == "dash-token"
    monitor = next(m for m in manifests if m["kind"] == "ServiceMonitor")
    auth = monitor["spec"]["endpoints"][0]["authorization"]
    assert auth == {"type": "Bearer", "credentials": {"name": "dash-token", "key": "token"}}
