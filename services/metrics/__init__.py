"""tessera-metrics: Prometheus exposition and the dashboard, computed from the bus only.

- `view.ClusterView`: the pure picture of the cluster (bus messages in);
- `exposition.ViewCollector`, `dashboard_state.dashboard_state`: what is served (pure);
- `feeds.Feeds` (NATS in) and `web.build_app` (HTTP out); `service.MetricsService` wires them.
"""
