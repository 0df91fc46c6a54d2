"""tessera-quota: namespace GPU quotas over NATS."""
