"""`python -m tessera.quota`: namespace GPU quotas over NATS."""

from tessera.service import idle_until_stopped, run_service


def main() -> None:
    run_service("quota", "namespace GPU quotas over NATS", idle_until_stopped)


if __name__ == "__main__":
    main()
