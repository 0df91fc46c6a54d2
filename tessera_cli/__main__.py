from tessera_cli.app import main

main()
