"""verify's NaN/Inf count: a fast aminmax pass first, the exact count only when it finds a non-finite
entry."""

from __future__ import annotations

import pytest
import torch

from pipeline.ondisk.integrity import _nonfinite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_nonfinite_entry_anywhere_is_counted(dtype, bad):
    h = torch.randn(300, 64).to(dtype)
    assert _nonfinite(h) == 0
    h[217, 5] = bad
    assert _nonfinite(h) == 1
    h[0, 0] = -bad if bad == bad else bad  # +inf and -inf together make the sum NaN: still counted
    assert _nonfinite(h) == 2


@pytest.mark.parametrize(
    "dtype, big", [(torch.bfloat16, 3.0e38), (torch.float16, 6.0e4), (torch.float32, 3.0e38)]
)
def test_finite_values_whose_sum_overflows_are_not_reported(dtype, big):
    """Large finite states overflow any sum of them (fp16's at only 65504); none is reported."""
    h = torch.full((4, 8), big, dtype=dtype)
    assert not torch.isfinite(h.sum())
    assert _nonfinite(h) == 0
