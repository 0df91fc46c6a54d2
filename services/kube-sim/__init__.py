"""tessera-kube-sim: local stand-in for apiserver, kube-scheduler and kubelet."""
