"""`python -m tessera.node_agent`: device discovery, device plugin, container regions."""

from tessera.service import idle_until_stopped, run_service


def main() -> None:
    run_service(
        "node-agent", "device discovery, device plugin, container regions", idle_until_stopped
    )


if __name__ == "__main__":
    main()
