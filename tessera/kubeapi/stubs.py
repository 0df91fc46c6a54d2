"""Generate the gRPC stubs of protos/ on first use, once per proto content.

The .proto files are ours (``protos/deviceplugin/v1beta1/api.proto``,
``protos/podresources/v1/api.proto``, and for DRA ``protos/pluginregistration/v1``,
``protos/dra/v1``, ``protos/drahealth/{v1alpha1,v1}``). Stubs are generated with grpcio-tools
into a directory named by the digest of the protos and the tool versions, so a changed proto or
an upgraded protobuf regenerates by itself, and several processes starting at once never see
half a tree (each generates into a private temporary directory and renames it into place).

Where the stubs go: ``tessera/kubeapi/generated/<digest>/`` when the package directory is
writable (a source checkout, ``make protos``), else the user's cache directory (a read-only
site-packages). That directory is appended to ``tessera.kubeapi.__path__``, so the stubs import
as ``tessera.kubeapi.deviceplugin.v1beta1.api_pb2``; the generated absolute imports are
rewritten to relative ones for that.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

PROTO_FILES = (
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "pluginregistration/v1/api.proto",
    "dra/v1/api.proto",
    "drahealth/v1alpha1/api.proto",
    "drahealth/v1/api.proto",
)
COMPLETE_MARKER = "COMPLETE"


class StubGenerationError(RuntimeError):
    """protoc failed or the protos cannot be found."""


def proto_root() -> Path:
    """Where the .proto files are: an installed copy next to this module, else the checkout."""
    override = os.environ.get("TESSERA_PROTOS_DIR")
    here = Path(__file__).resolve().parent
    candidates = [Path(override)] if override else []
    candidates += [here / "protos", here.parent.parent / "protos"]
    for candidate in candidates:
        if all((candidate / name).is_file() for name in PROTO_FILES):
            return candidate
    raise StubGenerationError(f"cannot find {PROTO_FILES} in any of {candidates}")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def proto_digest(root: Path) -> str:
    h = hashlib.sha256()
    for name in PROTO_FILES:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    h.update(_version("grpcio-tools").encode() + _version("protobuf").encode())
    return h.hexdigest()[:16]


def _cache_base() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "tessera" / "kubeapi"


def _generate(root: Path, out: Path) -> None:
    from grpc_tools import protoc  # heavy import: only when generating

    include = str(Path(protoc.__file__).parent / "_proto")
    for name in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(root / name),
        ]
        if protoc.main(args) != 0:
            raise StubGenerationError(f"protoc failed on {root / name}")
    for name in PROTO_FILES:
        parts = Path(name).parent.parts
        # Make every level a package and the generated imports relative.
        for depth in range(1, len(parts) + 1):
            (out.joinpath(*parts[:depth]) / "__init__.py").touch()
        dotted = ".".join(parts)
        for stub in out.joinpath(*parts).glob("*_pb2*.py"):
            text = stub.read_text()
            text = re.sub(rf"^from {re.escape(dotted)} import ", "from . import ", text, flags=re.M)
            stub.write_text(text)


def ensure_stubs() -> Path:
    """The directory holding generated stubs for the current protos (generating if needed)."""
    root = proto_root()
    digest = proto_digest(root)
    errors: list[str] = []
    for base in (Path(__file__).resolve().parent / "generated", _cache_base()):
        target = base / digest
        if (target / COMPLETE_MARKER).is_file():
            return target
        try:
            base.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
            # mkdtemp makes it 0700: generated once by root into site-packages (the image),
            # the tree must stay readable by the services' own users.
            tmp.chmod(0o755)
        except OSError as exc:
            errors.append(f"{base}: {exc}")
            continue
        try:
            _generate(root, tmp)
            (tmp / COMPLETE_MARKER).write_text(digest + "\n")
            try:
                os.rename(tmp, target)
            except OSError:
                # Another process won the race; its tree is identical.
                if not (target / COMPLETE_MARKER).is_file():
                    raise
            return target
        except OSError as exc:
            errors.append(f"{base}: {exc}")
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)
    raise StubGenerationError("cannot write generated stubs: " + "; ".join(errors))


def remove_stale(keep: Path) -> None:
    """Delete stub trees of older proto digests next to `keep` (make protos)."""
    for entry in keep.parent.iterdir():
        if entry != keep and entry.is_dir() and not entry.name.startswith(".tmp-"):
            shutil.rmtree(entry, ignore_errors=True)
