"""The speculators draft as pipeline/draft.py builds it: vocab mapping, attention kernel, save/load round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline import draft as draft_mod
from pipeline.train import check_inputs


def _model(inputs, tmp_path, d2t=None, t2d=None, seed=0):
    checked = check_inputs(inputs.config(tmp_path / "unused"))
    d2t = checked.d2t if d2t is None else d2t
    t2d = checked.t2d if t2d is None else t2d
    view = draft_mod.write_verifier_view(tmp_path / "view", checked.verifier, checked.target)
    config = draft_mod.build_speculator_config(target=checked.target, verifier_view=view, draft_vocab_size=len(d2t),
                                               vllm_aux_layer_ids=checked.vllm_aux_layer_ids, ttt_steps=3)
    draft_mod.set_attention(config, draft_mod.register_dense_attention())
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


def test_dense_mask_equals_speculators_reference(make_inputs, tmp_path):
    """The CPU attention mask equals speculators' own dense rendering of its block mask, also after TTT extension."""
    from speculators.models.eagle3.attention import (
        block_mask_to_dense_attention_mask,
        create_combined_mask_mod,
        extend_mask_for_draft_tokens,
    )
    from torch.nn.attention.flex_attention import create_block_mask

    total = 256
    lengths = torch.tensor([100, 60, 50])  # three packed documents and 46 padding positions
    mask = create_block_mask(create_combined_mask_mod(lengths, total), B=None, H=None, Q_LEN=total, KV_LEN=total, device="cpu")
    for step in range(3):
        kv = total * (step + 1)
        ours = draft_mod.dense_block_mask(mask, total, kv)
        ref = block_mask_to_dense_attention_mask(mask, torch.device("cpu"), torch.bool)[0, 0, :, :kv]
        assert torch.equal(ours, ref), f"TTT step {step}"
        mask = extend_mask_for_draft_tokens(mask)


def test_round_trip_through_speculators_from_pretrained(make_inputs, tmp_path):
    """A saved draft loads with speculators' from_pretrained into identical tensors and identical proposals."""
    inputs = make_inputs()
    model, _ = _model(inputs, tmp_path)
    with torch.no_grad():
        for p in model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the initial values: the load must really read them
    model.save_pretrained(tmp_path / "saved")
    loaded = draft_mod.load_draft(tmp_path / "saved")
    assert type(loaded).__mro__[1].__name__ == "Eagle3DraftModel"
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    model.eval()
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(1, 50, 3 * inputs.hidden, generator=g)
    ids = torch.randint(0, inputs.vocab, (1, 50), generator=g)
    with torch.no_grad():
        out_a = model(hidden_states=hs, input_ids=ids, ttt_steps=3)
        out_b = loaded(hidden_states=hs, input_ids=ids, ttt_steps=3)
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b, strict=True))


def test_plain_speculators_from_pretrained_still_broken():
    """Pin canary: speculators 0.4.0.1's own Eagle3DraftModel.from_pretrained passes `verifier` to the
    constructor (fixed upstream in PR #669); when this starts passing, drop the shim in pipeline/draft.py."""
    import inspect

    from speculators.models.eagle3 import Eagle3DraftModel

    params = inspect.signature(Eagle3DraftModel.__init__).parameters
    assert "verifier" not in params
    src = inspect.getsource(Eagle3DraftModel.__mro__[1].from_pretrained)
    assert "verifier=verifier" in src


def test_layer_config_from_mla_target_uses_plain_heads():
    """A DeepSeek-V3 (MLA) target yields a Llama draft layer with head_dim = hidden / heads and no rope scaling."""
    facts = draft_mod.TargetFacts.from_config_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168, "vocab_size": 163840,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 64,
        "intermediate_size": 18432, "rms_norm_eps": 1e-6, "rope_scaling": {"type": "yarn", "factor": 32},
    })
    cfg = draft_mod.draft_layer_config(facts)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size, cfg.num_hidden_layers) == (112, 64, 7168, 1)
    assert cfg.rope_scaling is None and cfg.tie_word_embeddings is False
    wrapped = draft_mod.TargetFacts.from_config_dict({"architectures": ["KimiK25ForConditionalGeneration"],
                                                      "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168,
                                                                      "vocab_size": 163840, "num_hidden_layers": 61,
                                                                      "num_attention_heads": 64}})
    assert wrapped.num_layers == 61 and wrapped.architectures == ("KimiK25ForConditionalGeneration",)


def test_flex_attention_refused_on_cpu():
    """Asking for flex attention on the CPU is a one-line error, not a crash in the backward pass."""
    from pipeline.errors import StageError

    with pytest.raises(StageError, match="no backward pass on the CPU"):
        draft_mod.choose_attention(torch.device("cpu"), "flex")
    assert draft_mod.choose_attention(torch.device("cpu")) == draft_mod.DENSE_ATTENTION
    assert draft_mod.choose_attention(torch.device("cuda")) == draft_mod.FLEX_ATTENTION


def test_dense_kernel_matches_flex_forward(make_inputs, tmp_path):
    """On a packed batch, the CPU kernel gives the same loss and proposals as speculators' flex attention."""
    from pipeline.train import Runtime, make_loader

    inputs = make_inputs()
    model, checked = _model(inputs, tmp_path)
    cfg = inputs.config(tmp_path / "out", max_len=128)
    batch = next(iter(make_loader(checked.train_files, cfg, Runtime(torch.device("cpu")), shuffle_seed=0)))
    assert len(batch["lengths"]) > 1  # several documents packed: the document mask matters
    results = {}
    model.eval()
    for impl in (draft_mod.FLEX_ATTENTION, draft_mod.DENSE_ATTENTION):
        draft_mod.set_attention(model.config, impl)
        with torch.no_grad():
            tokens, loss, _ = model(**batch, ttt_steps=3)
        results[impl] = (tokens, loss)
    (tf, lf), (td, ld) = results.values()
    assert torch.allclose(lf, ld, rtol=1e-4, atol=1e-5), (lf, ld)
    assert all(torch.equal(a, b) for a, b in zip(tf, td, strict=True))
