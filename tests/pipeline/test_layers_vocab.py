"""Layer-id rules and vocab-mapping invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import StageError
from pipeline.model.layers import default_layer_ids, parse_layer_ids, to_vllm_aux_ids, validate_layer_ids
from pipeline.model.vocab import (
    build_vocab_mapping,
    check_vocab_mapping,
    token_frequencies,
    vocab_mapping_problems,
)


def test_default_layer_ids_follow_the_convention():
    """The default is [2, L//2, L-3, L-1] and passes validation for real model depths."""
    assert default_layer_ids(61) == [2, 30, 58, 60]
    assert default_layer_ids(8) == [2, 4, 5, 7]
    for n in (7, 16, 32, 61, 80):
        assert validate_layer_ids(None, n) == default_layer_ids(n)


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        ([2, 4, 7], "exactly 4"),
        ([2, 4, 4, 7], "unique"),
        ([4, 2, 5, 7], "ascending"),
        ([2, 4, 5, 9], "out of range"),
        ([1, 2, 3, 6], "last id must be the last layer 7"),
        ([-1, 2, 3, 7], "out of range"),
    ],
)
def test_bad_layer_ids_are_rejected_with_the_reason(ids, fragment):
    """Every broken rule is named in the one-line error."""
    with pytest.raises(StageError, match=fragment) as exc:
        validate_layer_ids(ids, 8)
    assert "\n" not in str(exc.value)


def test_too_shallow_model_and_unparseable_ids():
    """A model too shallow for the defaults, and non-integer ids, give clear errors."""
    with pytest.raises(StageError, match="at least 7"):
        default_layer_ids(6)
    with pytest.raises(StageError, match="comma-separated integers"):
        parse_layer_ids("2,x,5")


def test_vllm_convention_is_input_of_the_next_layer():
    """The draft config's aux ids are k+1 for the three intermediate layers."""
    assert to_vllm_aux_ids([2, 30, 58, 60]) == [3, 31, 59]


@settings(max_examples=60, deadline=None)
@given(
    freq=st.dictionaries(st.integers(0, 499), st.integers(1, 1000), max_size=300),
    draft=st.integers(1, 500),
)
def test_vocab_mapping_invariants_hold_for_any_frequencies(freq, draft):
    """t2d.sum == draft vocab; arange + d2t sorted, unique and equal to nonzero(t2d); len(t2d) == target
    vocab."""
    d2t, t2d = build_vocab_mapping(freq, 500, draft)
    assert len(d2t) == draft and len(t2d) == 500 and t2d.sum() == draft
    targets = np.arange(draft) + d2t
    assert np.all(np.diff(targets) > 0)
    assert np.array_equal(targets, np.nonzero(t2d)[0])
    top = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))[:draft]
    assert all(t2d[t] for t, _ in top)


def test_broken_mappings_are_named():
    """Each broken invariant is reported, and check_vocab_mapping raises on any of them."""
    d2t, t2d = build_vocab_mapping({5: 3, 9: 2, 1: 1}, 16, 4)
    assert vocab_mapping_problems(d2t, t2d, 4, 16) == []
    assert any("len(d2t)" in p for p in vocab_mapping_problems(d2t, t2d, 5, 16))
    assert any("len(t2d)" in p for p in vocab_mapping_problems(d2t, t2d, 4, 17))
    shuffled = d2t.copy()
    shuffled[[0, 1]] = shuffled[[1, 0]] + np.array([1, -1])
    assert any("ascending" in p for p in vocab_mapping_problems(shuffled, t2d, 4, 16))
    bad_t2d = t2d.copy()
    bad_t2d[np.nonzero(~t2d)[0][0]] = True
    assert any("t2d.sum()" in p for p in vocab_mapping_problems(d2t, bad_t2d, 4, 16))
    with pytest.raises(StageError, match="vocab mapping invalid"):
        check_vocab_mapping(d2t, bad_t2d, 4, 16)


def test_token_frequencies_count_only_masked_tokens():
    """Tokens outside the loss mask are not counted."""
    ids = np.array([1, 2, 2, 3, 3, 3])
    mask = np.array([0, 1, 1, 0, 1, 0])
    assert token_frequencies(ids, mask) == {2: 2, 3: 1}
