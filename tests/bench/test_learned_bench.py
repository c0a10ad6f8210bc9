"""bench/learned_bench.py runs the product's stages in the documented order on what its recipe draws.

Cheap parts only (the whole --preset tiny path takes minutes on a shared 2-core CPU:
`make bench-learned-tiny`).
"""

from __future__ import annotations

from pathlib import Path

from bench import learned_bench
from pipeline.demo import learned


def test_plan_is_prepare_extract_hf_weights_train_at_k3_then_verify(tmp_path):
    """The stage command lines: hf extraction on the chosen device, the draft trained and measured at k=3."""
    p = learned_bench.PRESETS["h200"]
    steps = learned_bench.plan(tmp_path, p, "cuda", 16384)
    assert [name for name, _ in steps] == ["prepare", "extract", "weights", "train", "verify"]
    args = dict(steps)
    assert args["prepare"][args["prepare"].index("--draft-vocab-size") + 1] == "16384"
    assert args["extract"][args["extract"].index("--backend") + 1] == "hf"
    train = args["train"]
    assert train[train.index("--eval-k") + 1] == "3" and train[train.index("--device") + 1] == "cuda"
    assert train[train.index("--data") + 1] == str(Path(tmp_path) / "hidden_states")


def test_sampler_draws_the_same_bounded_windows_for_a_seed():
    """Windows are corpus lines in order, short enough to batch, and the same for the same seed."""
    texts = learned.corpus_texts(200_000)
    a = learned.make_conversations(texts, 20, seed=3, prompt_lines=8, answer_lines=16, weighted=True)
    b = learned.make_conversations(texts, 20, seed=3, prompt_lines=8, answer_lines=16, weighted=True)
    assert a == b
    for row in a:
        user, answer = row["messages"][1]["content"], row["messages"][2]["content"]
        name, shown = user.removeprefix("Continue ").split(":\n", 1)
        source = dict(texts)[name]
        assert f"{shown}\n{answer}" in source and len(shown) + len(answer) <= 3000
