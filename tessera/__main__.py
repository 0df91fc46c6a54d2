from tessera.cli.app import main

main()
