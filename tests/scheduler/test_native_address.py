"""`native_address.address_of` gives the address numpy gives (`array.ctypes.data`) for every
array a decision hands to C: writable or read-only (a list parsed from bytes), empty, a slice
past the start, 2-D and its rows, and arrays C must not read as one block (their address
still numpy's)."""

from __future__ import annotations

import numpy as np
from tessera.scheduler.native_address import address_of


def test_the_address_is_numpys_for_every_kind_of_array() -> None:
    base = np.arange(64, dtype=np.int64)
    frozen = np.frombuffer(base.tobytes(), dtype=np.int64)  # (read-only)
    grid = np.arange(60, dtype=np.int32).reshape(6, 10)
    arrays = [
        base, base[5:], base[5:9], base[:0], np.empty(0, dtype=np.uint8), frozen, frozen[3:],
        grid, grid[2], grid[4:], np.asfortranarray(grid), grid[:, 3], base[::2],
        np.empty(180_000, dtype=np.uint8)[8:].view(np.float64),
    ]  # fmt: skip
    assert not frozen.flags.writeable
    for array in arrays:
        assert address_of(array) == array.ctypes.data
