"""The `tessera` command line and the local-stack runner (`tessera up`, the end-to-end tests).

Not part of the contract: services import only `tessera`, never this package
(tests/foundation/test_architecture.py). One module per command, imported when it runs
(app.py); `locate.py` says how every command finds the stack.
"""
