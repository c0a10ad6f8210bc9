"""bench/train_compare.py: both trainers get one set and train the same draft; its figures come from their
logs.

The GPU run itself is `make bench-train-compare` (docs/benchmarks.md); here: the pure parts, and speculators'
own CLI resolving the command line the bench gives it (``--dry-run``: it builds the draft and saves it, no
training), so a flag speculators renamed or a default that no longer matches ours fails here first.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import train_compare
from tests.conftest import run_pipeline

CPU_SHIM = Path(__file__).resolve().parents[1] / "train" / "speculators_cpu"
# what `speculators train` needs on a CPU (mk/train.mk bench-train-compare passes the same)
CPU_SPECULATORS_ARGS = ("--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32", "--num-workers", "0")


def test_epoch_seconds_sums_each_started_to_completed_pair():
    """Seconds between each epoch's "started" and "completed" lines; an epoch left open gives None."""
    lines = [
        (1.0, "INFO Training epoch 1/2 started"),
        (3.5, "INFO Training epoch 1/2 completed"),
        (4.0, "INFO Validation epoch 1/2 started"),
        (5.0, "x Training epoch 2/2 started  trainer.py:737"),
        (9.0, "Training epoch 2/2 completed"),
    ]
    assert train_compare.epoch_seconds(lines) == pytest.approx(6.5)
    assert train_compare.epoch_seconds(lines[:-1]) is None
    assert train_compare.epoch_seconds([(0.0, "no epochs here")]) is None


def test_marginal_rate_counts_only_the_extra_epochs():
    """tokens x (long - short epochs) / (epoch seconds long - short): start-up and the first epoch cancel."""
    short = {"epoch_seconds": 30.0, "tokens_per_epoch": 1000}
    long = {"epoch_seconds": 50.0, "tokens_per_epoch": 1000}
    assert train_compare.marginal(short, long, (1, 3)) == pytest.approx(100.0)
    assert train_compare.marginal(long, short, (1, 3)) is None  # no time left for the extra epochs: no figure
    assert train_compare.marginal({"epoch_seconds": None}, long, (1, 3)) is None


@pytest.fixture(scope="module")
def one_set(tmp_path_factory, tiny_llama, conversations) -> Path:
    """prepare -> extract -> weights -> export-speculators on the tiny Llama, 12 samples."""
    from pipeline import prepare, weights
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.stage import run as extract_run

    root = tmp_path_factory.mktemp("compare")
    prepare.run(
        prepare.PrepareConfig(
            data=conversations,
            model=tiny_llama,
            out=root / "prepared",
            seq_length=128,
            draft_vocab_size=64,
            max_samples=12,
        )
    )
    extract_run(
        ExtractConfig(
            prepared=root / "prepared",
            model=tiny_llama,
            out=root / "hidden_states",
            device="cpu",
            verify=False,
            progress=False,
        )
    )
    weights.run(tiny_llama, root / "verifier")
    (root / "model").symlink_to(tiny_llama)
    proc = run_pipeline(
        "export-speculators",
        "--prepared",
        root / "prepared",
        "--data",
        root / "hidden_states",
        "--out",
        root / "speculators",
    )
    assert proc.returncode == 0, proc.stderr
    return root


def test_both_commands_train_one_set_at_the_same_settings(one_set):
    """Ours reads the extract output, speculators the export; epochs, packed length, lr, TTT steps and seed
    agree."""
    record = json.loads((one_set / "speculators" / "eagle-ops.json").read_text())
    opts = {"max_len": 1024, "lr": 2e-4, "speculators_extra": ()}
    ours, _ = train_compare.commands(one_set, "ours", 3, opts, record, "cpu")
    theirs, save = train_compare.commands(one_set, "speculators", 3, opts, record, "cpu")

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    assert value(ours, "--data") == str(one_set / "hidden_states")
    assert value(theirs, "--data-path") == str(one_set / "speculators")
    for a, b in (
        ("--epochs", "--epochs"),
        ("--max-len", "--total-seq-len"),
        ("--lr", "--lr"),
        ("--ttt-steps", "--ttt-steps"),
        ("--seed", "--seed"),
    ):
        assert value(ours, a) == value(theirs, b), a
    assert value(theirs, "--optimizer") == "adamw" and save.name == "cmp-speculators-3"
    defaults, _ = train_compare.commands(
        one_set, "speculators", 3, {**opts, "speculators_defaults": True}, record, "cpu"
    )
    assert "--optimizer" not in defaults


def test_speculators_cli_builds_the_same_draft_as_ours_from_the_bench_command(one_set, tmp_path):
    """`speculators train --dry-run` with the bench's words: it accepts every flag, resolves AdamW, and the
    draft it saves has our draft's shape-defining settings (norms, vocab, layer ids, one layer)."""
    import dataclasses

    from pipeline.train.stage import TrainConfig

    record = json.loads((one_set / "speculators" / "eagle-ops.json").read_text())
    opts = {
        "max_len": 256,
        "lr": 1e-3,
        "speculators_extra": CPU_SPECULATORS_ARGS,
    }
    argv, save = train_compare.commands(one_set, "speculators", 1, opts, record, "cpu")
    argv[argv.index("--save-path") + 1] = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(CPU_SHIM)}
    proc = subprocess.run(
        [*argv, "--dry-run"], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "optimizer/optimizer='adamw'" in log.replace("\n", ""), log[-3000:]
    saved = next(p for p in (tmp_path / "ckpt").rglob("config.json"))
    theirs = json.loads(saved.read_text())
    ours_default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}["norm_before_residual"]
    assert theirs["norm_before_residual"] is ours_default
    for key in ("norm_before_fc", "norm_output", "fc_norm"):  # pipeline/train/draft.py leaves these at False
        assert theirs.get(key, False) is False, (key, theirs.get(key))
    args = record["speculators_train_args"]
    ids = [int(x) for x in args[args.index("--target-layer-ids") + 1 :][:3]]
    assert theirs["draft_vocab_size"] == 64 and theirs["eagle_aux_hidden_state_layer_ids"] == ids
    assert theirs["transformer_layer_config"]["num_hidden_layers"] == 1


def test_both_tools_hold_out_the_same_samples_and_train_the_same_model(one_set):
    """One epoch of each tool as the bench runs them (CPU): ours holds out the samples speculators
    validates on, and both end at the same validation loss and step accuracies (they differed by 5% on a
    learned target while each held out its own samples)."""
    record = json.loads((one_set / "speculators" / "eagle-ops.json").read_text())
    # the eager loss: speculators' default (fused) needs Triton; ours trains eager
    # (pipeline/train/trainer.py loss_implementation)
    extra = (*CPU_SPECULATORS_ARGS, "--loss-implementation", "eager")
    opts = {"max_len": 256, "lr": 1e-3, "speculators_extra": extra}
    env = {**os.environ, "PYTHONPATH": str(CPU_SHIM)}
    ours = train_compare.run_one(one_set, "ours", 1, opts, record, "cpu", dict(os.environ))
    theirs = train_compare.run_one(one_set, "speculators", 1, opts, record, "cpu", env)
    assert ours["exit_code"] == 0 and theirs["exit_code"] == 0, (ours, theirs)
    held = json.loads((one_set / "cmp-ours-1" / "train_config.json").read_text())["eval_files"]
    assert held == ["data_10.pt", "data_11.pt"]  # int(12 x 0.9) = 10: speculators' val rows 10 and 11
    assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-4), (ours, theirs)
    assert ours["val_full_acc"] == pytest.approx(theirs["val_full_acc"], abs=1e-4), (ours, theirs)
    assert ours["steady_phase_ms"]["fetch_share"] is not None and theirs["steady_phase_ms"]["step_ms"] > 0


def test_step_profiles_parse_speculators_console_lines_and_skip_the_first_step():
    """Each step's fields are read wherever rich wrapped them (a field seen again starts the next step);
    the first step (compile) is left out of the steady figures."""
    lines = [
        (93.1, "INFO train/loss=2.688, profile/fetch_ms=2.11e+04,"),
        (
            93.1,
            "     profile/opt_ms=54.571, profile/step_ms=6.47e+04, profile/tokens_per_s=31.436, profile/x=1",
        ),
        (93.3, "     profile/step_ms=50.0, profile/tokens_per_s=4.0e+04, profile/memory_mb/start=9.0,"),
        (93.4, "     profile/tokens_per_s=2.0e+04, profile/fetch_frac=0.3, profile/h2d_ms=1.5,"),
        (93.4, "  profile/step_ms=150.0"),
    ]
    steps = train_compare.profiles_from_log(lines)
    assert [(s["tokens_per_s"], s["step_ms"]) for s in steps] == [
        (31.436, 64700.0),
        (40000.0, 50.0),
        (20000.0, 150.0),
    ]
    assert steps[2]["h2d_ms"] == 1.5 and "memory_mb" not in steps[1]
    assert train_compare.steady_rate(steps) == pytest.approx((40000 * 0.05 + 20000 * 0.15) / 0.2)
    assert train_compare.steady_rate(steps[:1]) is None
    assert train_compare.steady_phases(steps) is None  # no later step logged every phase


def test_steady_phases_give_each_phase_and_the_fetch_share_after_the_first_step():
    """Mean ms per phase over the steps after the first; the fetch share is total fetch over total step."""
    first = {"fetch_ms": 9000.0, "fwd_ms": 1.0, "bwd_ms": 1.0, "opt_ms": 1.0, "step_ms": 9003.0}
    a = {"fetch_ms": 2.0, "fwd_ms": 20.0, "bwd_ms": 10.0, "opt_ms": 2.0, "step_ms": 34.0, "h2d_ms": 1.0}
    b = {"fetch_ms": 10.0, "fwd_ms": 24.0, "bwd_ms": 12.0, "opt_ms": 2.0, "step_ms": 48.0, "h2d_ms": 3.0}
    phases = train_compare.steady_phases([first, a, b])
    assert phases == {
        "fetch_ms": 6.0,
        "fwd_ms": 22.0,
        "bwd_ms": 11.0,
        "opt_ms": 2.0,
        "step_ms": 41.0,
        "h2d_ms": 2.0,
        "fetch_share": round(12 / 82, 3),
    }
    assert "h2d_ms" not in train_compare.steady_phases(
        [first, a, {k: v for k, v in b.items() if k != "h2d_ms"}]
    )


def test_no_marginal_rate_is_explained_when_the_long_run_was_quicker():
    """A short run that paid the cold compile can take longer than the long one: no rate, and the reason."""
    short = {"epoch_seconds": 48.8, "tokens_per_epoch": 1000}
    long = {"epoch_seconds": 15.9, "tokens_per_epoch": 1000}
    assert train_compare.marginal(short, long, (1, 2)) is None
    assert "15.9 s, no more than the short run's 48.8 s" in train_compare.no_marginal_reason(short, long)
    assert train_compare.no_marginal_reason(long, short) is None
    assert train_compare.no_marginal_reason({"epoch_seconds": None}, long) is None


def test_our_step_profiles_come_from_metrics_jsonl(tmp_path):
    """metrics.jsonl rows with a profile give its numeric fields; val rows have none."""
    rows = [
        {"step": 0, "train": {}, "profile": {"tokens_per_s": 10.0, "step_ms": 9000.0}},
        {"step": 1, "train": {}, "profile": {"tokens_per_s": 1000.0, "step_ms": 20.0, "memory_mb": {"a": 1}}},
        {"step": 2, "val": {"loss_epoch": 1.5, "full_acc_0_epoch": 0.5}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train_compare.profiles_from_metrics(tmp_path) == [
        {"tokens_per_s": 10.0, "step_ms": 9000.0},
        {"tokens_per_s": 1000.0, "step_ms": 20.0},
    ]
    assert train_compare.last_val_ours(tmp_path) == {"val_loss": 1.5, "val_full_acc": [0.5]}
