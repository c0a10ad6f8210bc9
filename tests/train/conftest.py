"""Fixtures for the train stage: small real inputs in the on-disk contract, and the tiny-model pipeline.

``make_inputs`` writes hidden states, a vocab mapping, verifier weights and a target config.json with the
formats module (random tensors with a learnable structure: the target's greedy next token is a fixed
function of the current token, and the token sequence mostly follows that function), in well under a second.
``tiny_run`` runs the real prepare -> extract -> weights stages on the tiny random Llama of
pipeline/demo/tiny.py once per session.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.ondisk import formats
from pipeline.train.stage import TrainConfig
from tests.conftest import tmpfs


@dataclass(frozen=True)
class Inputs:
    data: Path
    prepared: Path
    verifier: Path
    model: Path
    hidden: int
    vocab: int
    draft_vocab: int
    layer_ids: tuple[int, ...]

    def config(self, out: Path, **overrides) -> TrainConfig:
        base = dict(
            data=self.data,
            verifier=self.verifier,
            out=out,
            prepared=self.prepared,
            model=self.model,
            epochs=2,
            lr=3e-3,
            max_len=128,
            eval_fraction=0.25,
            eval_max_samples=8,
            plots=False,
            device="cpu",
            num_workers=0,
        )
        base.update(overrides)
        return TrainConfig(**base)


def write_inputs(
    root: Path,
    *,
    samples: int = 12,
    length: int = 40,
    hidden: int = 64,
    vocab: int = 96,
    draft_vocab: int = 64,
    num_layers: int = 8,
    captured: int = 4,
    verifier_hidden: int | None = None,
    seed: int = 0,
) -> Inputs:
    """A consistent set of train-stage inputs; the knobs break one thing at a time."""
    g = torch.Generator().manual_seed(seed)
    layer_ids = (2, num_layers // 2, num_layers - 3, num_layers - 1)
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "vocab_size": vocab,
                "num_hidden_layers": num_layers,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "intermediate_size": 128,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 512,
                "pad_token_id": 0,
            }
        )
    )
    # target: the last layer's state at token t points at lm_head row successor(t), so its greedy next token
    # is successor(t)
    vh = verifier_hidden or hidden
    lm_head = torch.randn(vocab, vh, generator=g)
    embed = torch.randn(vocab, vh, generator=g)
    successor = torch.randperm(draft_vocab, generator=g)  # greedy next token stays inside the draft vocab ids
    draft_ids = torch.arange(draft_vocab)  # the draft vocab = the first draft_vocab target ids
    verifier = root / "verifier"
    verifier.mkdir()
    from safetensors.torch import save_file

    save_file(
        {"embed_tokens.weight": embed, "norm.weight": torch.ones(vh), "lm_head.weight": lm_head},
        str(verifier / "verifier.safetensors"),
    )
    (verifier / "verifier.json").write_text(
        json.dumps({"source": str(model), "hidden_size": vh, "vocab_size": vocab})
    )
    data = root / "hidden_states"
    data.mkdir()
    lengths = {}
    for i in range(samples):
        ids = torch.empty(length, dtype=torch.int64)
        ids[0] = torch.randint(0, draft_vocab, (1,), generator=g)
        for t in range(1, length):  # mostly a chain t -> successor(t), so several draft steps are learnable
            jump = torch.rand(1, generator=g).item() < 0.1
            ids[t] = torch.randint(0, draft_vocab, (1,), generator=g) if jump else successor[ids[t - 1]]
        last = lm_head[draft_ids[successor[ids]]][:, :hidden] * 3 + 0.1 * torch.randn(
            length, hidden, generator=g
        )
        # the first auxiliary layer at token t already points at the token two steps ahead (as real middle
        # layers do)
        ahead = lm_head[draft_ids[successor[successor[ids]]]][:, :hidden]
        aux = [ahead + 0.1 * torch.randn(length, hidden, generator=g)] + [
            torch.randn(length, hidden, generator=g) for _ in range(captured - 2)
        ]
        mask = torch.ones(length, dtype=torch.int64)
        mask[:4] = 0
        formats.write_sample(formats.data_file(data, i), ids, [*aux, last], mask)
        lengths[i] = length
    formats.write_sample_lengths(data, lengths)
    formats.write_data_config(
        data,
        formats.DataConfig(
            model=str(model),
            layer_ids=list(layer_ids),
            num_layers=num_layers,
            hidden_size=hidden,
            dtype="float32",
            num_samples=samples,
            seq_length=length + 1,
            prepared=str(root / "prepared"),
            backend="synthetic",
        ),
    )
    prepared = root / "prepared"
    prepared.mkdir()
    d2t = np.zeros(draft_vocab, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[:draft_vocab] = True
    formats.write_vocab(prepared, d2t, t2d)
    formats.write_token_freq(prepared / formats.TOKEN_FREQ, {int(t): 10 + int(t) for t in range(draft_vocab)})
    return Inputs(data, prepared, verifier, model, hidden, vocab, draft_vocab, layer_ids)


@pytest.fixture
def make_inputs(tmp_path):
    counter = iter(range(100))

    def make(**kwargs) -> Inputs:
        return write_inputs(tmp_path / f"inputs{next(counter)}", **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_llama, conversations) -> Path:
    """The real prepare -> extract -> weights stages on the tiny random Llama, with the full vocab as draft
    vocab.

    A random-weight target's greedy tokens have nothing to do with the data's frequent tokens, so a draft
    vocabulary chosen from data frequencies would exclude most of what the target emits.
    """
    return run_stages(tiny_llama, conversations, tmp_path_factory.mktemp("tiny-run"))


def run_stages(model: Path, conversations: Path, root: Path) -> Path:
    """prepare -> extract -> weights on ``model`` into ROOT/{prepared,hidden_states,verifier}, the full vocab
    as draft vocab (in process, on the CPU)."""
    from pipeline import prepare, weights
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.stage import run as extract_run

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prepare.run(
        prepare.PrepareConfig(
            data=conversations, model=model, out=root / "prepared", seq_length=128, draft_vocab_size=vocab
        )
    )
    extract_run(
        ExtractConfig(
            prepared=root / "prepared",
            model=model,
            out=root / "hidden_states",
            device="cpu",
            verify=False,
            progress=False,
        )
    )
    weights.run(model, root / "verifier")
    return root


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A complete train run (4 epochs, acceptance measured, plots drawn) on synthetic inputs."""
    from pipeline.train.stage import run

    root = tmp_path_factory.mktemp("trained")
    inputs = write_inputs(root / "inputs", samples=16)
    cfg = inputs.config(root / "out", epochs=4, lr=1e-2, eval_fraction=0.25, plots=True, warmup_steps=0)
    summary = run(cfg, log=lambda m: None)
    return inputs, cfg, summary


@pytest.fixture
def small_disk(tmp_path):
    """A states dir on a 1 MiB tmpfs: room for two or three of the tiny Llama's states."""
    with tmpfs(tmp_path / "states", "1m") as states_dir:
        yield states_dir


# ------------------------------------------------------------ produced states (--states-mode online|hybrid)


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory, tiny_llama, conversations) -> dict:
    """prepare (full vocab as draft vocab) and weights for the tiny Llama; the first SAMPLES samples
    (tests/train/states_helpers.py)."""
    from tests.train.states_helpers import make_stage_inputs

    return make_stage_inputs(tmp_path_factory.mktemp("states-inputs"), tiny_llama, conversations)


@pytest.fixture(scope="module")
def offline(stage_inputs, tmp_path_factory) -> dict:
    """The produced modes' reference: extract (one sample per forward) then offline train, in process."""
    from pipeline.train.stage import run
    from tests.train.states_helpers import extract_per_sample, states_config

    root = tmp_path_factory.mktemp("offline")
    extract_per_sample(stage_inputs, root / "states")
    cfg = states_config(stage_inputs, root / "states", root / "out")
    return {"cfg": cfg, "summary": run(cfg, log=lambda m: None)}
