"""`python -m tessera.kubeapi`: (re)generate the gRPC stubs now (what `make protos` runs)."""

from tessera.kubeapi.stubs import ensure_stubs, remove_stale

if __name__ == "__main__":
    target = ensure_stubs()
    remove_stale(target)
    import tessera.kubeapi  # noqa: F401  (proves the stubs import)

    print(f"gRPC stubs ready in {target}")
