"""Node registrations as the scheduler reads them: a heartbeat costs a check, not a decode.

A node agent re-puts its registration every `TESSERA_NODE_HEARTBEAT_S` (5 s): at 20,000 nodes that
is 4,000 values a second, nearly all differing from the node's last one only in `heartbeat_at`.
Decoding, validating and re-summarising each would take a large share of a core. So the
scheduler keeps, per node, a fingerprint of the last valid payload without its heartbeat
(checked by msgspec, wire_fast.py: one C pass); a payload with the same fingerprint is the last
valid registration with a new heartbeat (its devices list is the same object, so the index sees
nothing to rebuild). Anything else is decoded and validated as before: by wire_fast when it is
canonical, else by the shared codec. Decoded devices share one fields-set per shape, intern
their repeated strings and have key-sharing dicts.
"""

from __future__ import annotations

import sys
from typing import Any

from tessera.codec import decode
from tessera.models import NodeRegistration

from . import wire_fast


class RegistrationCodec:
    def __init__(self) -> None:
        # key -> (fingerprint of the last valid payload but its heartbeat, or None until a
        # heartbeat asks for it, and the registration read from it)
        self._known: dict[str, tuple[int | None, Any]] = {}
        self._sets: dict[frozenset[str], set[str]] = {}
        self._parsed: tuple[bytes, Any] | None = None

    def heartbeat_only(
        self, key: str, payload: bytes
    ) -> NodeRegistration | wire_fast.RegistrationWire | None:
        """The node's last valid registration with the payload's heartbeat, when nothing else
        differs; else None (decode and validate it)."""
        known = self._known.get(key)
        if known is None:
            return None
        digest, registration = known
        if digest is None:  # kept unbuilt (`read`): its fingerprint, once a heartbeat asks
            digest = registration.fingerprint()  # type: ignore[union-attr]
            self._known[key] = (digest, registration)
        parsed = wire_fast.parse_registration(payload)
        if parsed is None or wire_fast.fingerprint(parsed) != digest:
            return None  # (an accepted payload without a heartbeat is not remembered)
        beat = parsed.data.heartbeat_at
        if type(registration) is wire_fast.RegistrationWire:
            return registration.with_heartbeat(beat)
        return registration.model_copy(update={"heartbeat_at": beat})  # type: ignore[union-attr]

    def read(self, payload: bytes) -> NodeRegistration | wire_fast.RegistrationWire:
        """`decode`, except that a canonical payload giving every field (what every node agent
        writes) is checked but not built: a RegistrationWire, which validation and the index
        read as it is and which builds the same NodeRegistration when something needs it."""
        parsed = wire_fast.parse_registration(payload)
        if parsed is not None:
            wire = wire_fast.registration_wire(parsed)
            if wire is not None:
                return wire
            self._parsed = (payload, parsed)  # for `accepted`, which usually follows
            return wire_fast.registration_from(parsed)
        return self._decode(payload)

    def decode(self, payload: bytes) -> NodeRegistration:
        """tessera.codec.decode (same value, same CodecError), devices slimmed."""
        parsed = wire_fast.parse_registration(payload)
        if parsed is not None:
            self._parsed = (payload, parsed)  # for `accepted`, which usually follows
            return wire_fast.registration_from(parsed)
        return self._decode(payload)

    def _decode(self, payload: bytes) -> NodeRegistration:
        registration = decode(payload, NodeRegistration)
        for device in registration.devices:
            names = frozenset(device.__pydantic_fields_set__)
            shared = self._sets.get(names)
            if shared is None:
                shared = self._sets[names] = set(names)
            object.__setattr__(device, "__pydantic_fields_set__", shared)
            values = device.__dict__
            for field in ("uuid", "type", "mode"):
                if type(values[field]) is str:
                    values[field] = sys.intern(values[field])
        return registration

    def accepted(
        self, key: str, payload: bytes, registration: NodeRegistration | wire_fast.RegistrationWire
    ) -> None:
        """The registration was validated and applied: later heartbeats of it are cheap."""
        last, self._parsed = self._parsed, None
        if type(registration) is wire_fast.RegistrationWire:
            self._known[key] = (None, registration)  # fingerprinted at its first heartbeat
            return
        parsed = last[1] if last is not None and last[0] is payload else (
            wire_fast.parse_registration(payload)
        )
        digest = wire_fast.fingerprint(parsed) if parsed is not None else None
        if digest is None:  # not canonical, or no heartbeat: every value of it is decoded
            self._known.pop(key, None)
        else:
            self._known[key] = (digest, registration)

    def forget(self, key: str) -> None:
        self._known.pop(key, None)
