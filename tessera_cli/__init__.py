"""The `tessera` command line: one module per command group, registered in app.py."""
