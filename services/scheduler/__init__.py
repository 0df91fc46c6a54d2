"""tessera-scheduler: kube-scheduler extender with HAMi's placement rules on a CAS ledger.

Pure decision code: `cards` (a node's GPUs and usage), `rules` (the fit checks), `placement`
(fitting a pod on a node), `index` and `decide` (choosing among candidate nodes). I/O:
`ledger` (CAS writes), `filtering` / `binding` / `release` (the ledger protocol's steps),
`quota_client`, `engine` (the `Scheduler` composing them), `api` (HTTP), `runtime` (watches).
"""
