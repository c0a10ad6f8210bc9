"""The offline acceptance arithmetic, on hand-made proposals whose answer is known."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.evaluate import Tally, constant, correct_matrix, greedy_tokens, valid_positions


def test_perfect_proposals_accept_k_plus_bonus():
    """Proposals equal to the greedy continuation give acceptance length k + 1 and rates of 1."""
    greedy = torch.tensor([5, 6, 7, 8, 9, 10])
    k = 3
    proposals = torch.stack([torch.roll(greedy, -j) for j in range(k)])  # proposal j at i = greedy[i + j]
    pos = valid_positions(torch.ones(6, dtype=torch.long), k)
    assert pos.tolist() == [0, 1, 2, 3]
    t = Tally(k)
    t.add(correct_matrix(proposals, greedy, pos))
    r = t.result()
    assert r["acceptance_length"] == pytest.approx(4.0)
    assert r["per_position"] == [1.0, 1.0, 1.0] and r["positions"] == 4


def test_rejection_stops_the_chain():
    """A wrong first proposal makes later correct proposals count for nothing (prefix acceptance)."""
    greedy = torch.tensor([1, 2, 3, 4])
    proposals = torch.tensor([[9, 2, 3, 4], [2, 3, 4, 0]])  # position 0: first wrong, second right
    pos = torch.tensor([0, 1, 2])
    t = Tally(2)
    t.add(correct_matrix(proposals, greedy, pos))
    r = t.result()
    # position 0: rejected at once; 1: both accepted; 2: both accepted
    assert r["per_position"] == pytest.approx([2 / 3, 2 / 3])
    assert r["conditional"] == pytest.approx([2 / 3, 1.0])
    assert r["acceptance_length"] == pytest.approx(1 + 4 / 3)


def test_valid_positions_follow_loss_mask_and_leave_room_for_k():
    """Only assistant positions with k future targets are measured."""
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1])
    assert valid_positions(mask, 3).tolist() == [1, 2, 4]


def test_constant_baseline_counts_runs_of_that_token():
    """A constant proposal is accepted exactly where the greedy tokens repeat that token."""
    greedy = torch.tensor([7, 7, 1, 7, 7, 7])
    item = {"input_ids": torch.zeros(6, dtype=torch.long)}
    t = Tally(2)
    t.add(correct_matrix(constant(7, 2)(item), greedy, torch.arange(5)))
    assert t.result()["per_position"] == pytest.approx([4 / 5, 3 / 5])  # i = 0, 3, 4 keep both


def test_greedy_tokens_use_final_norm_then_lm_head():
    """The target's greedy token is argmax(lm_head(rmsnorm(h) * w)): the norm weight changes the answer."""
    h = torch.tensor([[1.0, 2.0]])
    lm_head = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert greedy_tokens(h, torch.tensor([1.0, 1.0]), lm_head, 1e-6).tolist() == [1]
    assert greedy_tokens(h, torch.tensor([5.0, 1.0]), lm_head, 1e-6).tolist() == [0]


def test_ngram_continuations_take_the_longest_earliest_match_and_stop_at_the_prefix_end():
    """Prompt lookup: the longest earlier suffix match wins, at its first occurrence, cut at the known
    tokens."""
    from pipeline.train.evaluate import ngram_continuations

    toks = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    got = ngram_continuations(toks, 3)
    assert got[0] == []  # one token: nothing before it
    assert got[4] == [2, 3, 9]  # prefix ends with 1: its first occurrence (index 0) is followed by 2, 3, 9
    assert got[6] == [9, 1, 2]  # suffix 1,2,3 (length 3) first seen at 0..2, then 9, 1, 2
    assert got[10] == [9, 1, 2]  # 1,2,3 seen twice: the earliest occurrence's continuation
    assert ngram_continuations([5, 5], 3)[1] == [5]  # the continuation never runs past the prefix
    assert (
        ngram_continuations([1, 2, 3, 4, 7, 2, 3, 4], 2, n_min=4)[7] == []
    )  # 2,3,4 is too short for n_min 4


def test_ngram_baseline_proposes_from_the_context_in_the_shifted_alignment():
    """At shifted index i the baseline knows the unshifted ids [: i + 2] and proposes what followed their
    match."""
    from pipeline.train.evaluate import ngram_context

    context = torch.tensor([4, 5, 6, 4, 5, 6, 4])
    item = {"context_ids": context, "input_ids": context[1:]}
    out = ngram_context(2)(item)
    assert out.shape == (2, 6)
    assert out[:, 0].tolist() == [-1, -1]  # knows [4, 5]: no earlier match
    assert out[:, 2].tolist() == [5, 6]  # knows [4, 5, 6, 4]: 4 was followed by 5, 6
    greedy = context[2:].clone()  # a target that repeats its context, then leaves it (9)
    greedy = torch.cat([greedy, torch.tensor([9])])
    t = Tally(2)
    t.add(correct_matrix(out, greedy, torch.arange(2, 5)))
    assert t.result()["per_position"] == pytest.approx([1.0, 2 / 3])
