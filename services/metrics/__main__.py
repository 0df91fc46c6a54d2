"""`python -m tessera.metrics`: Prometheus exposition and the dashboard."""

from tessera.service import run_service

from .service import run


def main() -> None:
    run_service("metrics", "Prometheus exposition and the dashboard", run)


if __name__ == "__main__":
    main()
