"""verify's recompute and alignment checks against a target that does not reproduce itself: the figures of a
random dsv3-9b MoE with INT4 experts at bf16 on an H100 (docs/benchmarks-raw/2026-12-06-quant/rerun/,
noise_probe.py: each file's stored states against a batch-1 recompute, and the target's batch-1 states
against the same sample computed beside another). The check still fails there; its message says why."""

import json
from pathlib import Path

import pytest
import torch

from pipeline.model import recompute
from pipeline.verify import _agreement_cause

RAW = Path(__file__).parents[2] / "docs/benchmarks-raw/2026-12-06-quant/rerun"
LAYERS = [2, 8, 13, 15]


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_the_h100_sets_fail_and_the_message_names_the_targets_own_movement(backend):
    rows = json.loads((RAW / f"noise_probe_states-{backend}.json").read_text())["rows"]
    assert len(rows) == 8
    for r in rows:
        stored, own = r["stored_vs_b1"], r["b2_vs_b1"]
        assert max(stored) > 0.1  # the bf16 tolerance fails every file of both sets
        note = recompute.self_difference_note(own, stored, LAYERS, 0.1)
        assert "its states cannot be confirmed to 0.1" in note, note
        assert f"up to {max(own):.3g}" in note


def test_a_stored_tensor_of_another_shape_is_the_states_fault_on_a_moving_target():
    note = recompute.self_difference_note([0.0, 0.2, 0.2, 0.3], [0.05, 0.4, float("inf"), 0.4], LAYERS, 0.1)
    assert note.endswith("at layer 13: the states are at fault there"), note


def test_a_steady_target_names_the_states_and_the_layer():
    note = recompute.self_difference_note([0.0, 0.01, 0.2, 0.3], [0.05, 0.4, 0.35, 0.4], LAYERS, 0.1)
    assert note.startswith("the target reproduces itself to 0.01 at layer 8 beside another sample")
    assert note.endswith("the states are at fault there")


class Batched:
    """A stand-in for the hf backend: a sample's states depend on the batch it is computed in, by ``noise``
    (a random MoE at bf16) or not at all (noise 0)."""

    def __init__(self, noise: float):
        self.noise, self.batches = noise, []

    def capture(self, batch):
        self.batches.append([len(ids) for ids in batch])
        out = []
        for ids in batch:
            base = torch.arange(len(ids) * 4, dtype=torch.float32).reshape(len(ids), 4) + 1
            g = torch.Generator().manual_seed(len(batch))
            out.append(
                [base + self.noise * base.norm() / base.numel() ** 0.5 * torch.randn(base.shape, generator=g)]
            )
        return out


@pytest.mark.parametrize("length", [1, 2, 160, 4096, 5000, 20000])
def test_the_probe_batch_is_extraction_sized_with_the_sample_first_and_longest(length):
    """A failed file is computed again in a batch of about PROBE_TOKENS padded tokens (a sample beside only
    its first half was bit-identical to itself alone on the H100), never less than two rows."""
    ids = list(range(length))
    rows = recompute.probe_batch(ids)
    assert rows[0] == ids and len(rows) >= 2
    assert all(row == ids[: max(1, length // 2)] for row in rows[1:])
    padded = len(rows) * length
    assert padded <= max(recompute.PROBE_TOKENS, 2 * length)
    if length <= recompute.PROBE_TOKENS // 2:
        assert padded > recompute.PROBE_TOKENS - 2 * length


def test_the_alignment_probe_sends_one_row_to_the_head_and_leaves_the_model_as_it_was(tiny_llama):
    """The target's argmax beside the probe batch: on a steady fp32 target it equals the argmax alone, only
    the sample's own row reaches the output head (the logits stay one row's size), and the hook is gone."""
    from transformers import AutoModelForCausalLM

    from pipeline.verify import _target_argmax

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (40,))
    head, seen = model.get_output_embeddings(), []
    probe = head.register_forward_hook(lambda _, args, out: seen.append((args[0].shape[0], out.shape[0])))
    alone = _target_argmax(model, ids)
    beside = _target_argmax(model, ids, beside=True)
    probe.remove()
    assert seen == [(1, 1), (1, 1)]
    assert torch.equal(alone, beside)
    assert not head._forward_pre_hooks
    # a model that names no output-head module: every row's logits, the same argmax for the sample's row
    model.get_output_embeddings = lambda: None
    seen.clear()
    probe = head.register_forward_hook(lambda _, args, out: seen.append(out.shape[0]))
    assert torch.equal(_target_argmax(model, ids, beside=True), alone)
    probe.remove()
    assert seen == [len(recompute.probe_batch(ids.tolist()))]


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_spot_recompute_computes_a_failed_file_again_in_the_probe_batch(tmp_path, noise):
    ids = list(range(10))
    stored = torch.arange(40, dtype=torch.float32).reshape(10, 4) + 1.5  # off by enough to fail 1e-3
    backend = Batched(noise)
    checks, _, moved = recompute.spot_recompute(
        lambda p: {"input_ids": torch.tensor(ids), "hidden_states": [stored]},
        tmp_path,
        [0],
        [3],
        "float32",
        backend,
    )
    # alone, then first in the probe batch (copies of its first half after it)
    assert backend.batches == [[10], [10] + [5] * (recompute.PROBE_TOKENS // 10 - 1)]
    assert checks[0].status == "fail"
    own = moved["data_0.pt"][0]
    if noise:
        assert own > 0.1 and "cannot be confirmed to 0.001" in checks[0].detail
    else:
        assert own == 0 and "the states are at fault there" in checks[0].detail


def test_the_alignment_message_names_the_targets_own_agreement():
    assert _agreement_cause(None, 0.95) == "states are not the last layer's pre-norm output"
    assert _agreement_cause(0.99, 0.95) == "states are not the last layer's pre-norm output"
    assert "agrees with its own argmax on only 0.700" in _agreement_cause(0.7, 0.95)
