"""Reading manifests as `kubectl apply -f` does: files, directories (`-R` for subdirectories),
`-` for stdin, several documents per file, `kind: List`. Every document remembers its file and
line, so an error names them and quotes the YAML's own text.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .locate import CliError

SUFFIXES = (".yaml", ".yml", ".json")
_SEPARATOR = re.compile(r"^---(\s|$)")


class ManifestError(CliError):
    pass


@dataclass
class Manifest:
    source: str  # the file as given (or "-")
    line: int  # where the document starts, 1-based
    text: str  # the document's own text
    doc: dict[str, Any]
    start: int = 0  # the line `text` starts at (before comments), 1-based; 0: same as `line`

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def kind(self) -> str:
        return str(self.doc.get("kind") or "")

    @property
    def name(self) -> str:
        return str((self.doc.get("metadata") or {}).get("name") or "")

    def quote(self, needle: str) -> str:
        """`file:line: "the line"` for the first line of this document holding `needle`."""
        for offset, line in enumerate(self.text.splitlines()):
            if needle and needle in line and not line.lstrip().startswith("#"):
                return f'{self.source}:{(self.start or self.line) + offset}: "{line.strip()}"'
        return ""


def expand(paths: list[str], recursive: bool = False) -> list[str]:
    """Files in the order given; a directory's YAML/JSON files sorted by name."""
    files: list[str] = []
    for given in paths:
        if given == "-":
            files.append(given)
            continue
        path = Path(given)
        if path.is_dir():
            pattern = "**/*" if recursive else "*"
            found = sorted(p for p in path.glob(pattern) if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise ManifestError(f"{given}: no .yaml, .yml or .json file in this directory")
            files += [str(p) for p in found]
        elif path.is_file():
            files.append(given)
        else:
            raise ManifestError(f'the path "{given}" does not exist')
    return files


def _chunks(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each `---`-separated document."""
    chunks: list[tuple[int, str]] = []
    start, lines = 1, []
    for number, line in enumerate(text.splitlines(), start=1):
        if _SEPARATOR.match(line):
            chunks.append((start, "\n".join(lines)))
            start, lines = number + 1, []
        else:
            lines.append(line)
    chunks.append((start, "\n".join(lines)))
    return chunks


def parse(source: str, text: str) -> list[Manifest]:
    import yaml

    manifests: list[Manifest] = []
    for start, chunk in _chunks(text):
        try:
            doc = yaml.safe_load(chunk)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            if mark is None:
                raise ManifestError(f"{source}:{start}: invalid YAML: {problem}") from None
            lines = chunk.splitlines()
            quoted = lines[mark.line].strip() if mark.line < len(lines) else ""
            raise ManifestError(
                f'{source}:{start + mark.line}: invalid YAML: {problem}: "{quoted}"'
            ) from None
        if doc is None:
            continue
        first = next((i for i, line in enumerate(chunk.splitlines()) if line.strip()
                      and not line.lstrip().startswith("#")), 0)  # fmt: skip
        manifest = Manifest(source, start + first, chunk, doc if isinstance(doc, dict) else {},
                            start)
        if not isinstance(doc, dict):
            raise ManifestError(f"{manifest.where}: expected an object with apiVersion, kind "
                                f'and metadata: "{chunk.strip().splitlines()[0][:80]}"')
        if doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            for item in doc["items"]:
                if isinstance(item, dict):
                    manifests.append(Manifest(source, manifest.line, chunk, item, start))
            continue
        manifests.append(manifest)
    return manifests


def load(paths: list[str], recursive: bool = False) -> list[Manifest]:
    manifests: list[Manifest] = []
    for source in expand(paths, recursive):
        try:
            text = sys.stdin.read() if source == "-" else Path(source).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{source}: cannot read: {exc}") from None
        manifests += parse(source, text)
    return manifests


def check(manifest: Manifest) -> None:
    """What every object needs before it is sent: a kind and a name."""
    doc = manifest.doc
    if not manifest.kind:
        raise ManifestError(f"{manifest.where}: the object has no kind "
                            f'("{manifest.text.strip().splitlines()[0][:80]}")')
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not (meta.get("name") or meta.get("generateName")):
        quoted = manifest.quote("metadata") or manifest.quote("kind:")
        raise ManifestError(f"{manifest.where}: {manifest.kind} has no metadata.name"
                            + (f" ({quoted})" if quoted else ""))
