"""verify's NaN/Inf count: a fast float32 sum first, the exact count only when the sum is not finite."""

from __future__ import annotations

import pytest
import torch

from pipeline.verify import _nonfinite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_nonfinite_entry_anywhere_is_counted(dtype, bad):
    h = torch.randn(300, 64).to(dtype)
    assert _nonfinite(h) == 0
    h[217, 5] = bad
    assert _nonfinite(h) == 1
    h[0, 0] = -bad if bad == bad else bad  # +inf and -inf together make the sum NaN: still counted
    assert _nonfinite(h) == 2


def test_finite_values_whose_sum_overflows_are_not_reported():
    """Large finite states overflow the float32 sum; the exact count then finds nothing."""
    h = torch.full((4, 8), 3.0e38, dtype=torch.bfloat16)
    assert not torch.isfinite(h.sum(dtype=torch.float32))
    assert _nonfinite(h) == 0
