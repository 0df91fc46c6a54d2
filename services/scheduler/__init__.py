"""tessera-scheduler: kube-scheduler extender and the allocation ledger."""
