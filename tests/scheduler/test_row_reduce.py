"""The row reductions the refusal steps and the walk's summaries use equal numpy's `axis=1`
reduces on every shape the index's per-card arrays take (any card width, views, NaN, inf)."""

import numpy as np
import pytest
from tessera.scheduler.row_reduce import row_any, row_counts, row_max


@pytest.mark.parametrize("width", [1, 2, 3, 4, 6, 7, 8, 9, 12, 14, 16, 17, 24])
def test_row_reductions_equal_numpy(width: int) -> None:
    rng = np.random.default_rng(width)
    for rows in (0, 1, 5, 300):
        for share in (0.0, 0.05, 0.5, 1.0):
            mask = rng.random((rows, width)) < share
            for view in (mask, mask[::-1], mask[:, ::-1], np.asfortranarray(mask)):
                assert np.array_equal(row_counts(view), np.count_nonzero(view, axis=1))
                assert np.array_equal(row_any(view), view.any(axis=1))
        values = rng.integers(-3, 3, (rows, width)).astype(np.float64)
        values[rng.random(values.shape) < 0.1] = np.inf
        values[rng.random(values.shape) < 0.1] = -np.inf
        values[rng.random(values.shape) < 0.05] = np.nan
        for view in (values, values[:, ::-1]):
            expected = view.max(axis=1) if rows else np.zeros(0)
            assert np.array_equal(row_max(view), expected, equal_nan=True)
        ints = rng.integers(-5, 5, (rows, width))
        if rows:
            assert np.array_equal(row_max(ints), ints.max(axis=1))
