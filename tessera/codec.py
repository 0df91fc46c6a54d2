"""Wire codec: pydantic models as msgpack maps that carry their schema name and version.

Every message on the bus is `{"schema": <model name>, "version": <int>, "data": {...}}`. A reader
refuses versions it does not know with a clear error instead of misreading the payload.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError


class CodecError(ValueError):
    """A payload that cannot be decoded into the expected model."""


class Message(BaseModel):
    """Base of every bus message. Subclasses bump SCHEMA_VERSION on incompatible changes."""

    # Validators and serializers are built on first use, not at import: most services use few
    # of the models (a fifth of a service's import time went to building the others).
    model_config = ConfigDict(extra="ignore", frozen=False, defer_build=True)
    SCHEMA_VERSION: ClassVar[int] = 1
    # Older versions this build can still read (fields added since then have defaults).
    READABLE_VERSIONS: ClassVar[frozenset[int]] = frozenset({1})

    def wire_version(self) -> int:
        """The version this message is written with: SCHEMA_VERSION, unless a model writes one
        its older readers can read when the message uses nothing they would misread."""
        return type(self).SCHEMA_VERSION


M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    """Serialise a message with its schema name and version."""
    envelope = {
        "schema": type(message).__name__,
        "version": message.wire_version(),
        "data": message.model_dump(mode="json"),
    }
    return msgpack.packb(envelope, use_bin_type=True)


def decode(payload: bytes, model: type[M]) -> M:
    """Parse `payload` as `model`; CodecError says exactly what is wrong."""
    envelope = _unpack(payload)
    schema = envelope.get("schema")
    if schema != model.__name__:
        raise CodecError(f"expected a {model.__name__} message, got schema {schema!r}")
    version = envelope.get("version")
    if version not in model.READABLE_VERSIONS | {model.SCHEMA_VERSION}:
        raise CodecError(
            f"{model.__name__} schema version {version!r} is not supported "
            f"(this build reads {sorted(model.READABLE_VERSIONS | {model.SCHEMA_VERSION})})"
        )
    try:
        return model.model_validate(envelope.get("data"))
    except ValidationError as exc:
        raise CodecError(f"invalid {model.__name__}: {exc.error_count()} error(s): {exc}") from exc


def peek_schema(payload: bytes) -> tuple[str, int]:
    """(schema name, version) of a payload without validating its data."""
    envelope = _unpack(payload)
    return str(envelope.get("schema")), int(envelope.get("version", -1))


def _unpack(payload: bytes) -> dict[str, Any]:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        envelope = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(envelope, dict) or "schema" not in envelope or "data" not in envelope:
        raise CodecError("payload is not a Tessera message envelope")
    return envelope
