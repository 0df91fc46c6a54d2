"""`python -m tessera.metrics`: Prometheus exposition and the dashboard."""

from tessera.service import idle_until_stopped, run_service


def main() -> None:
    run_service("metrics", "Prometheus exposition and the dashboard", idle_until_stopped)


if __name__ == "__main__":
    main()
