"""`python -m tessera.admission`: mutating admission webhook (HAMi rules)."""

from tessera.service import idle_until_stopped, run_service


def main() -> None:
    run_service("admission", "mutating admission webhook (HAMi rules)", idle_until_stopped)


if __name__ == "__main__":
    main()
