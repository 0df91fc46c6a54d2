"""Reductions along the short rows of the index's per-card arrays (a node's cards), faster than
numpy's `axis=1` reduces, which pay per row: for rows of 8 cards `np.count_nonzero(mask, axis=1)`
is ~20x slower than `row_counts`, `mask.any(axis=1)` ~10x `row_any`'s, `values.max(axis=1)` ~6x
`row_max`'s. Equal results (`tests/scheduler/test_row_reduce.py`)."""

from __future__ import annotations

import numpy as np

_BYTES_SUM = np.uint64(0x0101010101010101)


def row_counts(mask: np.ndarray) -> np.ndarray:
    """How many of each row's entries are True (`np.count_nonzero(mask, axis=1)`, faster
    for short rows: eight booleans a word, their bytes summed by one multiplication)."""
    width = mask.shape[1]
    if width % 8 or not mask.flags.c_contiguous:
        return np.count_nonzero(mask, axis=1)
    words = mask.view(np.uint64)
    total = (words[:, 0] * _BYTES_SUM) >> np.uint64(56)
    for column in range(1, width // 8):
        total += (words[:, column] * _BYTES_SUM) >> np.uint64(56)
    return total.astype(np.int64)


_WORDS = {0: np.uint64, 4: np.uint32, 2: np.uint16, 6: np.uint16}  # (by width % 8)


def row_any(mask: np.ndarray) -> np.ndarray:
    """Whether each row has a True entry (`mask.any(axis=1)`, ~10x faster for rows of a few
    cards: a reduce along a short axis pays per row; here a row's booleans are read as one or
    a few words, each nonzero where one of its bytes is)."""
    word = _WORDS.get(mask.shape[1] % 8)
    if word is None or not mask.flags.c_contiguous or not mask.shape[1]:
        return mask.any(axis=1)
    words = mask.view(word)
    found = words[:, 0] != 0
    for column in range(1, words.shape[1]):
        found |= words[:, column] != 0
    return found


def row_max(values: np.ndarray) -> np.ndarray:
    """Each row's largest value (`values.max(axis=1)`, NaN propagating alike), column by
    column: a reduce along a short axis is ~6x slower for rows of a few cards."""
    if not values.shape[1]:
        return values.max(axis=1)
    found = values[:, 0].copy()
    for column in range(1, values.shape[1]):
        np.maximum(found, values[:, column], out=found)
    return found
