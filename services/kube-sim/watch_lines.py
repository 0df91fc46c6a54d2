"""Watch events as the stream sends them, encoded once for every stream that sends them.

A pod's write is sent to each HTTP watch that selects it (the scheduler's, the node agent's,
quota's, metrics', a `kubectl get -w`): the same event of the same stored object, encoded the
same way. The store hands read-only watchers the stored object itself (`Watcher.copies`), and a
stored object never changes, so its encoded line is kept here (the object held beside it, so its
`id` is not reused while kept) and the other streams send the bytes already made.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from tessera.kube_sim.store import KubeObject

KEEP = 512  # recent events: every stream reads an event within moments of the write


class EncodedEvents:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._lines: OrderedDict[tuple[str, int], tuple[KubeObject, bytes]] = OrderedDict()

    def line(self, event_type: str, obj: KubeObject) -> bytes:
        """`{"type": ..., "object": ...}` and a newline, as a watch stream sends it."""
        key = (event_type, id(obj))
        kept = self._lines.get(key)
        if kept is not None and kept[0] is obj:
            return kept[1]
        encoded = json.dumps({"type": event_type, "object": obj}).encode() + b"\n"
        self._lines[key] = (obj, encoded)
        if len(self._lines) > self.keep:
            self._lines.popitem(last=False)
        return encoded
