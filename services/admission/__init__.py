"""tessera-admission: mutating admission webhook (HAMi rules)."""
