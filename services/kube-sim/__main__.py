"""`python -m tessera.kube_sim`: local stand-in for apiserver, kube-scheduler and kubelet."""

from tessera.service import idle_until_stopped, run_service


def main() -> None:
    run_service(
        "kube-sim", "local stand-in for apiserver, kube-scheduler and kubelet", idle_until_stopped
    )


if __name__ == "__main__":
    main()
