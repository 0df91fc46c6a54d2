"""`python -m tessera.scheduler`: kube-scheduler extender and the allocation ledger."""

from tessera.service import idle_until_stopped, run_service


def main() -> None:
    run_service(
        "scheduler", "kube-scheduler extender and the allocation ledger", idle_until_stopped
    )


if __name__ == "__main__":
    main()
