"""tessera-metrics: Prometheus exposition and the dashboard."""
