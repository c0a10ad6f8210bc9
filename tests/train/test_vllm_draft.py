"""vLLM 0.32 (CPU build) serves a draft trained by `pipeline train` with real EAGLE-3 speculative decoding.

Runs in .venv-vllm (`make test-vllm`); elsewhere the vLLM import fails the test. The draft is trained on the
real stages' output for the tiny random Llama with the full vocab as draft vocab (the case that failed to load
with speculators 0.4's drafts: "no module or parameter named 'draft_id_to_target_id'"); the online measurement
runs the target alone and the target + draft in vLLM on the held-out prompts.
"""

from __future__ import annotations

import json

import pytest

from pipeline.train.stage import TrainConfig, run

pytestmark = pytest.mark.vllm

K = 3


def train_and_serve(root, model, out, env: dict[str, str | None]) -> tuple[TrainConfig, dict]:
    """A train run into OUT on ROOT's stage outputs with offline and online acceptance, under ``env`` (None:
    unset); vLLM on the CPU needs a KV-cache size (1 GiB)."""
    cfg = TrainConfig(
        data=root / "hidden_states",
        verifier=root / "verifier",
        out=out,
        model=model,
        prepared=root / "prepared",
        epochs=1,
        lr=1e-3,
        max_len=256,
        device="cpu",
        plots=False,
        ttt_steps=K,
        save_dtype="float32",
        online_eval=True,
        online_prompts=4,
        online_max_tokens=16,
    )
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"VLLM_CPU_KVCACHE_SPACE": "1", **env}.items():
            mp.delenv(name, raising=False) if value is None else mp.setenv(name, value)
        return cfg, run(cfg, log=lambda m: None)


@pytest.fixture(scope="module")
def served(tiny_run, tiny_llama, tmp_path_factory):
    """A train run with offline and online acceptance on the tiny Llama's stage outputs."""
    return train_and_serve(tiny_run, tiny_llama, tmp_path_factory.mktemp("vllm-draft") / "train", {})


def test_vllm_serves_the_draft_with_the_targets_greedy_output(served):
    """vLLM loads the full-vocab draft as an EAGLE-3 speculator, proposes with it, and greedy output is
    unchanged."""
    _, summary = served
    online = summary["eval"]["online"]
    assert online["greedy_equal"] and online["greedy_equal_prompts"] == online["prompts"] == 4, online
    assert online["drafts"] > 0 and online["draft_tokens"] == K * online["drafts"], online
    assert 1.0 <= online["acceptance_length"] <= K + 1 and len(online["per_position"]) == K
    # vLLM's figure is its own counters': 1 + accepted / drafts
    assert online["acceptance_length"] == pytest.approx(1 + online["accepted_tokens"] / online["drafts"])


def test_closing_table_prints_online_next_to_offline(served, capsys):
    """The acceptance table shows the offline estimate and vLLM's online acceptance length of the same
    draft."""
    from pipeline.train.cli import print_table

    _, summary = served
    print_table(summary)
    text = capsys.readouterr().out
    ev = summary["eval"]
    assert f"{ev['draft']['acceptance_length']:.3f}" in text
    assert "online (vLLM" in text and f"{ev['online']['acceptance_length']:.3f}" in text
    assert "equals the target alone" in text


def test_evaluate_measures_the_draft_against_no_speculation_and_ngram(
    served, tiny_llama, conversations, tmp_path
):
    """`pipeline evaluate` on the trained draft, through its real command line: one engine per method (none,
    n-gram k=2, EAGLE-3 k=2), both phases; the draft's rows carry vLLM's counters, greedy output equals the
    target's alone (fp32 on the CPU), and the table, the plot and the verdict are written. The CPU build's
    speeds are recorded, not judged. Then the same command with the bracket (none again, after the others):
    the three engines measured are reused from their kept results and only the second `none` starts, and
    the drift between the two no-speculation runs is told."""
    from tests.conftest import run_pipeline

    cfg, _ = served
    out = tmp_path / "eval"
    args = (
        "evaluate", "--model", tiny_llama, "--draft", cfg.out, "--prompts", conversations, "--out", out,
        "--k", "2", "--num-prompts", "3", "--max-tokens", "12", "--ignore-eos", "--batch", "4",
        "--dtype", "float32",
    )  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = run_pipeline(*args, "--no-bracket", env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "evaluate.json").read_text())
    rows = {(r["label"], r["phase"]): r for r in result["rows"]}
    methods = ("none", "ngram k=2", "eagle3 k=2")
    assert set(rows) == {(m, p) for m in methods for p in ("batch1", "batched")}
    assert result["none_drift"] == {} and "between its runs" not in result["verdict"]
    for phase in ("batch1", "batched"):
        eagle, none = rows[("eagle3 k=2", phase)], rows[("none", phase)]
        # k per step, fewer where a request's max_tokens leaves less room
        assert eagle["drafts"] > 0 and eagle["drafts"] < eagle["draft_tokens"] <= 2 * eagle["drafts"], eagle
        assert eagle["acceptance_length"] == pytest.approx(1 + eagle["accepted_tokens"] / eagle["drafts"])
        assert len(eagle["per_position"]) == 2 and none["drafts"] == 0 and none["acceptance_length"] is None
        n = 3 if phase == "batch1" else 4  # --batch 4: the 3 prompts, then the first again
        assert eagle["greedy_equal"] and eagle["prompts"] == n, eagle
        assert eagle["output_tokens"] == none["output_tokens"] == n * 12
    assert rows[("none", "batch1")]["tpot_ms"] > 0 and rows[("none", "batched")]["batch"] == 4
    assert rows[("eagle3 k=2", "batch1")]["decode_speedup"] > 0
    assert rows[("eagle3 k=2", "batched")]["decode_speedup"] is None
    assert (out / "evaluate.png").stat().st_size > 1000
    assert "| batch 1 | eagle3 k=2 |" in (out / "evaluate.md").read_text()
    assert result["verdict"] in proc.stdout and "best draft eagle3 k=2" in result["verdict"]
    assert "greedy output equal" in result["verdict"]
    assert not any(r["reused"] for r in result["rows"])

    # Asked again with the bracket (the default): the three engines measured above are reused (same target,
    # draft, prompts and settings); only `none again` starts an engine, and the speed-ups move to the mean of
    # both `none` runs.
    again = run_pipeline(*args, "--overwrite", env=env, timeout=1200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("reused the result measured at") == 3, again.stderr[-3000:]
    assert "evaluate: none again on 3 prompts" in again.stderr
    second = json.loads((out / "evaluate.json").read_text())
    by_label = {(r["label"], r["phase"]): r for r in second["rows"]}
    assert {label for label, _ in by_label} == {*methods, "none again"}
    assert set(second["none_drift"]) == {"batch1", "batched"} and "between its runs" in second["verdict"]
    moved = ("reused", "speedup", "decode_speedup")  # the speed-ups are against the new mean of both nones
    for key, row in rows.items():
        assert by_label[key]["reused"]
        assert {k: v for k, v in by_label[key].items() if k not in moved} == {
            k: v for k, v in row.items() if k not in moved
        }
    for phase in ("batch1", "batched"):
        none_again = by_label[("none again", phase)]
        assert not none_again["reused"] and none_again["greedy_equal"]
        mean = (rows[("none", phase)]["output_tokens_per_s"] + none_again["output_tokens_per_s"]) / 2
        eagle = by_label[("eagle3 k=2", phase)]
        assert eagle["speedup"] == pytest.approx(eagle["output_tokens_per_s"] / mean)
    assert "Reused from an earlier run" in (out / "evaluate.md").read_text()


def test_served_config_is_in_vllms_convention(served, tiny_llama):
    """vLLM reads the draft as Eagle3LlamaForCausalLM with aux ids [3, 5, 6] = captured outputs of 2, 4, 5 +
    1."""
    from vllm.engine.arg_utils import EngineArgs

    cfg, _ = served
    draft = cfg.out / "draft"
    engine = EngineArgs(
        model=str(tiny_llama),
        max_model_len=256,
        enforce_eager=True,
        dtype="float32",
        speculative_config={"model": str(draft), "method": "eagle3", "num_speculative_tokens": K},
    ).create_engine_config()
    spec = engine.speculative_config
    assert spec.method == "eagle3" and spec.num_speculative_tokens == K
    hf = spec.draft_model_config.hf_config
    assert spec.draft_model_config.architectures == ["Eagle3LlamaForCausalLM"]
    saved = json.loads((draft / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
    aux = getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or (
        getattr(hf, "eagle_config", None) or {}
    ).get("eagle_aux_hidden_state_layer_ids")
    assert list(aux) == [3, 5, 6]
    assert hf.draft_vocab_size == saved["draft_vocab_size"] == saved["transformer_layer_config"]["vocab_size"]


@pytest.fixture(scope="module")
def served_deepseek(tmp_path_factory, conversations):
    """The same stages and train run on a tiny DeepseekV3 target with MLA on in vLLM: its MLA head sizes are
    the real model's (latent 512 + 64, the only size the CPU MLA kernel takes; 128/64/128, which the GPU's
    MLA prefill takes), so vLLM serves it with MLA as a GPU would."""
    from pipeline.demo.tiny import build_tiny_model
    from tests.train.conftest import run_stages

    root = tmp_path_factory.mktemp("dsv3-draft")
    model = build_tiny_model("deepseek_v3", root / "model")
    config = json.loads((model / "config.json").read_text())
    config["scoring_func"] = "sigmoid"  # what real DeepSeek-V3 configs carry (vLLM's default is softmax)
    (model / "config.json").write_text(json.dumps(config))
    run_stages(model, conversations, root)
    return train_and_serve(
        root, model, root / "train", {"VLLM_MLA_DISABLE": None}
    )  # MLA on: how a DeepSeek target is served


def test_vllm_serves_a_deepseek_targets_draft(served_deepseek):
    """vLLM serves a DeepseekV3 target (MLA + MoE) with the EAGLE-3 draft `pipeline train` made for it: the
    engine starts (patch 0004: without it the draft's attention and the target's MLA have no KV block size in
    common on the CPU), the draft proposes K tokens per step, and vLLM's counters give the acceptance length.

    Greedy equality with the target alone is not asserted here, unlike the Llama test: on vllm-cpu 0.32.0 the
    MLA target verifies a draft's K+1 tokens through MLA's prefill-with-context path (CPU_MLA takes
    single-token decode only), whose logits differ from its decode path's by far more than fp32 rounding
    (docs/train.md); the printed figures say how many prompts agreed."""
    cfg, summary = served_deepseek
    online = summary["eval"]["online"]
    assert "error" not in online, online
    print(f"\nDeepseekV3 target + draft on vllm-cpu: {online}")
    assert online["prompts"] == 4, online
    assert online["drafts"] > 0 and online["draft_tokens"] == K * online["drafts"], online
    assert 1.0 <= online["acceptance_length"] <= K + 1 and len(online["per_position"]) == K
    assert online["acceptance_length"] == pytest.approx(1 + online["accepted_tokens"] / online["drafts"])
    draft = json.loads((cfg.out / "draft" / "config.json").read_text())
    assert draft["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
