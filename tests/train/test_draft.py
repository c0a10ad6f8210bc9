"""The speculators 0.9 draft as pipeline/train/draft.py builds it: vocab mapping, attention kernel, save/load
round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.train import draft as draft_mod
from pipeline.train.inputs import check_inputs


def _model(inputs, tmp_path, d2t=None, t2d=None, seed=0, attention=draft_mod.DENSE_ATTENTION):
    checked = check_inputs(inputs.config(tmp_path / "unused"))
    d2t = checked.d2t if d2t is None else d2t
    t2d = checked.t2d if t2d is None else t2d
    view = draft_mod.write_verifier_view(tmp_path / "view", checked.verifier, checked.target)
    config = draft_mod.build_speculator_config(
        target=checked.target,
        verifier_view=view,
        draft_vocab_size=len(d2t),
        vllm_aux_layer_ids=checked.vllm_aux_layer_ids,
        ttt_steps=3,
    )
    draft_mod.set_attention(config, attention)
    torch.manual_seed(seed)
    return draft_mod.new_draft(config, d2t, t2d), checked


def test_vocab_mapping_selects_lm_head_rows(make_inputs, tmp_path):
    """The draft's lm_head holds exactly the verifier lm_head rows that t2d selects, in target-id order."""
    inputs = make_inputs()
    rng = np.random.default_rng(0)
    chosen = np.sort(rng.choice(inputs.vocab, size=inputs.draft_vocab, replace=False))
    t2d = np.zeros(inputs.vocab, dtype=bool)
    t2d[chosen] = True
    d2t = chosen - np.arange(inputs.draft_vocab)
    model, checked = _model(inputs, tmp_path, d2t=d2t, t2d=t2d)
    full = checked.verifier["lm_head.weight"].float()
    assert torch.equal(model.lm_head.weight.data, full[torch.from_numpy(chosen)])
    assert torch.equal(model.verifier_lm_head.weight.data, full[torch.from_numpy(chosen)])
    assert not torch.equal(model.lm_head.weight.data, full[: inputs.draft_vocab])  # not simply the first rows
    assert torch.equal(model.d2t, torch.from_numpy(d2t)) and int(model.t2d.sum()) == inputs.draft_vocab
    assert torch.equal(model.embed_tokens.weight.data, checked.verifier["embed_tokens.weight"].float())
    assert torch.equal(model.verifier_norm.weight.data, checked.verifier["norm.weight"].float())


def test_full_vocab_draft_stores_no_mapping(make_inputs, tmp_path):
    """A draft whose vocab is the target's saves no d2t/t2d: vLLM has no draft_id_to_target_id to load one
    into."""
    inputs = make_inputs(draft_vocab=96)
    model, _ = _model(inputs, tmp_path)
    model.save_pretrained(tmp_path / "saved")
    assert draft_mod.read_checkpoint_vocab(tmp_path / "saved") == (None, None)
    loaded = draft_mod.load_draft(tmp_path / "saved", verifier_view=tmp_path / "view")
    assert loaded.d2t is None and loaded.lm_head.weight.shape[0] == inputs.vocab


def test_round_trip_through_speculators_from_pretrained(make_inputs, tmp_path):
    """A saved draft loads with speculators' from_pretrained into identical tensors and identical
    proposals."""
    inputs = make_inputs()
    model, _ = _model(inputs, tmp_path)
    with torch.no_grad():
        for p in model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the initial values: the load must really read them
    model.save_pretrained(tmp_path / "saved")
    loaded = draft_mod.load_draft(tmp_path / "saved", verifier_view=tmp_path / "view")
    assert type(loaded).__name__ == "Eagle3DraftModel"
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    model.eval()
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(1, 50, 3 * inputs.hidden, generator=g)
    ids = torch.randint(0, inputs.vocab, (1, 50), generator=g)
    docs = torch.zeros_like(ids)
    with torch.no_grad():
        out_a = model(hidden_states=hs, input_ids=ids, document_ids=docs, ttt_steps=3)
        out_b = loaded(hidden_states=hs, input_ids=ids, document_ids=docs, ttt_steps=3)
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b, strict=True))


def test_speculators_step_timer_still_needs_an_accelerator():
    """Pin canary: speculators 0.9's step timer synchronizes an accelerator unconditionally, which fails on
    the CPU; when this starts passing without one, drop the timer swap in pipeline/train/stage.py
    (_on_host)."""
    from speculators.train.trainer import _StepTimer

    timer = _StepTimer(enabled=True)
    if torch.accelerator.current_accelerator() is None:
        with pytest.raises(RuntimeError):
            timer.mark("start")


def test_layer_config_from_mla_target_uses_plain_heads():
    """A DeepSeek-V3 (MLA) target yields a Llama draft layer with head_dim = hidden / heads and no rope
    scaling."""
    facts = draft_mod.TargetFacts.from_config_dict(
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "vocab_size": 163840,
            "num_hidden_layers": 61,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "head_dim": 64,
            "intermediate_size": 18432,
            "rms_norm_eps": 1e-6,
            "rope_scaling": {"type": "yarn", "factor": 32},
        }
    )
    cfg = draft_mod.draft_layer_config(facts)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size, cfg.num_hidden_layers) == (
        112,
        64,
        7168,
        1,
    )
    assert (
        cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
        and cfg.tie_word_embeddings is False
    )
    wrapped = draft_mod.TargetFacts.from_config_dict(
        {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": {
                "model_type": "deepseek_v3",
                "hidden_size": 7168,
                "vocab_size": 163840,
                "num_hidden_layers": 61,
                "num_attention_heads": 64,
            },
        }
    )
    assert wrapped.num_layers == 61 and wrapped.architectures == ("KimiK25ForConditionalGeneration",)


def test_flex_attention_refused_on_cpu():
    """Asking for flex attention on the CPU is a one-line error, not a crash in the backward pass."""
    from pipeline.errors import StageError

    with pytest.raises(StageError, match="no backward pass on the CPU"):
        draft_mod.choose_attention(torch.device("cpu"), "flex")
    assert draft_mod.choose_attention(torch.device("cpu")) == draft_mod.DENSE_ATTENTION
    assert draft_mod.choose_attention(torch.device("cuda")) == draft_mod.FLEX_ATTENTION


def test_rope_of_a_transformers5_config_reaches_the_draft():
    """A target saved by transformers 5 (rope_parameters, no rope_theta) gives the draft its theta and
    scaling."""
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "vocab_size": 96,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = draft_mod.draft_layer_config(draft_mod.TargetFacts.from_config_dict(raw))
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.rope_parameters["rope_type"] == "llama3"
    old = draft_mod.TargetFacts.from_config_dict(
        {
            **{k: v for k, v in raw.items() if k != "rope_parameters"},
            "rope_theta": 1e6,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert old.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


def test_dense_kernel_matches_flex_forward(make_inputs, tmp_path):
    """On a packed batch, the CPU kernel gives the same loss and proposals as speculators' flex attention."""
    from pipeline.train.runtime import Runtime
    from pipeline.train.stage import make_loader
    from pipeline.train.trainer import get_trainer_kwargs

    inputs = make_inputs()
    dense, checked = _model(inputs, tmp_path)
    flex, _ = _model(inputs, tmp_path, attention=draft_mod.FLEX_ATTENTION)
    flex.load_state_dict(dense.state_dict())
    cfg = inputs.config(tmp_path / "out", max_len=128)
    batch = next(
        iter(
            make_loader(
                checked.train_files,
                cfg,
                Runtime(torch.device("cpu")),
                shuffle_seed=0,
                hidden_size=inputs.hidden,
            )
        )
    )
    assert int(batch["document_ids"].max()) > 0  # several documents packed: the document mask matters
    call, _ = get_trainer_kwargs(dense, cfg, torch.device("cpu"))
    results = []
    for model in (flex, dense):
        model.eval()
        with torch.no_grad():
            tokens, loss, _ = model(**{k: v for k, v in batch.items() if k != "error_records"}, **call)
        results.append((tokens, loss))
    (tf, lf), (td, ld) = results
    assert torch.allclose(lf, ld, rtol=1e-4, atol=1e-5), (lf, ld)
    assert all(torch.equal(a, b) for a, b in zip(tf, td, strict=True))


def test_bf16_batches_are_the_fp32_ones_rounded_and_step_alike(make_inputs, tmp_path):
    """GPUs get bf16 batches (stage.states_dtype, what speculators' own loader hands its trainer): the same
    packing as fp32 batches with the states rounded to bf16, and under the bf16 autocast of a GPU step (run
    here with the CPU's bf16 autocast) the draft takes them and gives the fp32 batch's loss up to rounding."""
    from pipeline.train.data import make_loader
    from pipeline.train.stage import states_dtype
    from pipeline.train.trainer import get_trainer_kwargs

    assert states_dtype(torch.device("cuda")) == torch.bfloat16
    assert states_dtype(torch.device("cpu")) == torch.float32
    inputs = make_inputs()
    model, checked = _model(inputs, tmp_path)

    def first(dtype):
        loader = make_loader(
            checked.train_files,
            max_len=128,
            hidden_size=inputs.hidden,
            world_size=1,
            rank=0,
            seed=0,
            workers=0,
            pin_memory=False,
            dtype=dtype,
        )
        return next(iter(loader))

    b32, b16 = first(torch.float32), first(torch.bfloat16)
    assert b32.keys() == b16.keys()
    for key, value in b32.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.dtype == torch.float32 and b16[key].dtype == torch.bfloat16, key
            assert torch.equal(value.to(torch.bfloat16), b16[key]), key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, b16[key]), key
        else:
            assert value == b16[key], key
    call, _ = get_trainer_kwargs(model, inputs.config(tmp_path / "out"), torch.device("cpu"))
    losses = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in (b32, b16):
            _, loss, _ = model(**{k: v for k, v in batch.items() if k != "error_records"}, **call)
            losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[1] == pytest.approx(losses[0], rel=1e-3), losses
