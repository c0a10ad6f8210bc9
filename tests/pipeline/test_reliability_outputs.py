"""Outputs: an --out that is, contains or lies inside an input is refused before anything is deleted; one
writer at a time (a second is refused naming the holder); a failed final rename leaves no staging dir."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, tmpfs
from tests.pipeline.test_reliability_readers import cli, linked_copy, refused


def _tree(path):
    return sorted((str(p.relative_to(path)), p.is_symlink()) for p in path.rglob("*"))


OVERLAPS = {
    # case: (stage, which input the output collides with, how, flags)
    "prepare-out-is-model": ("prepare", "model", "is", ["--overwrite"]),
    "prepare-out-contains-data": ("prepare", "data", "contains", ["--overwrite"]),
    "prepare-out-inside-model": ("prepare", "model", "inside", []),
    "prepare-out-symlink-to-model": ("prepare", "model", "symlink", ["--overwrite"]),
    "weights-out-is-model": ("weights", "model", "is", ["--overwrite"]),
    "weights-out-contains-model": ("weights", "model", "contains", ["--overwrite"]),
    "extract-out-is-prepared": ("extract", "prepared", "is", ["--overwrite"]),
    "extract-out-is-model": ("extract", "model", "is", ["--overwrite"]),
    "extract-resume-into-prepared": ("extract", "prepared", "is", ["--resume"]),
    "extract-out-contains-prepared": ("extract", "prepared", "contains", ["--overwrite"]),
}


@pytest.mark.parametrize("case", sorted(OVERLAPS))
def test_output_overlapping_an_input_is_refused_and_the_input_survives(
    tmp_path, monkeypatch, capsys, tiny_llama, conversations, prepared_llama, case
):
    """--out equal to, containing, inside or a symlink to an input: one line naming both, the input
    untouched."""
    stage, victim, how, flags = OVERLAPS[case]
    root = tmp_path / "inputs"
    model = linked_copy(tiny_llama, root / "model")
    prepared = linked_copy(prepared_llama, root / "prepared")
    data = root / "data" / "rows.jsonl"
    data.parent.mkdir()
    data.symlink_to(conversations)
    paths = {"model": model, "prepared": prepared, "data": data}
    before = {k: _tree(v.parent if k == "data" else v) for k, v in paths.items()}
    target = paths[victim]
    out = {"is": target, "contains": target.parent, "inside": target / "sub"}.get(how)
    if how == "symlink":
        out = tmp_path / "link"
        out.symlink_to(target)
    args = {
        "prepare": ["--data", data, "--model", model],
        "weights": ["--model", model],
        "extract": ["--prepared", prepared, "--model", model, "--no-progress"],
    }[stage]
    refused(
        cli(monkeypatch, capsys, stage, *args, "--out", out, *flags),
        "writing there would destroy an input",
        f"--{victim}",
    )
    after = {k: _tree(v.parent if k == "data" else v) for k, v in paths.items()}
    assert after == before


HOLDER = """
import sys, time
from pipeline.ondisk.outdir import output_lock
with output_lock(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """A real process holding the lock of tmp_path/out through pipeline.ondisk.outdir, SIGKILLed at the
    end."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [PYTHON, "-c", HOLDER, str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "holding"
    yield out, proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("stage", ["prepare", "weights", "extract"])
def test_second_writer_is_refused_naming_the_holder(
    holder, monkeypatch, capsys, tiny_llama, conversations, prepared_llama, stage
):
    """While another process writes an output, a stage writing there is refused naming its pid; nothing
    written."""
    out, proc = holder
    args = {
        "prepare": ["--data", conversations, "--model", tiny_llama],
        "weights": ["--model", tiny_llama],
        "extract": ["--prepared", prepared_llama, "--model", tiny_llama, "--no-progress"],
    }[stage]
    refused(
        cli(monkeypatch, capsys, stage, *args, "--out", out, "--overwrite"),
        f"is being written by pid {proc.pid}",
        "wait for it to finish",
    )
    assert not out.exists()
    assert not list(out.parent.glob(".out.staging-*"))


def test_lock_of_a_killed_writer_is_free_at_once(holder, monkeypatch, capsys, tiny_llama):
    """SIGKILL of the holder frees the lock (the kernel drops the flock): the next writer succeeds."""
    out, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    rc, err = cli(monkeypatch, capsys, "weights", "--model", tiny_llama, "--out", out)
    assert rc == 0, err
    assert (out / "verifier.safetensors").is_file()


def test_shards_of_one_output_lock_separately(tmp_path):
    """Two hosts' shards of one --out (world size > 1 on a shared disk) do not refuse each other; one shard
    twice does."""
    from pipeline.errors import StageError
    from pipeline.ondisk.outdir import output_lock

    out = tmp_path / "states"
    with (
        output_lock(out, "rank-0"),
        output_lock(out, "rank-1"),
        pytest.raises(StageError, match="is being written by pid"),
        output_lock(out, "rank-0"),
    ):
        pass


@pytest.fixture
def mounted_out(tmp_path):
    """An output directory that is a mount point (rename(2) of it fails with EBUSY), holding an old output."""
    with tmpfs(tmp_path / "out", "4m") as out:
        (out / "old-output.txt").write_text("previous run\n")
        yield out


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
@pytest.mark.parametrize("stage", ["prepare", "weights"])
def test_failed_final_rename_names_the_cause_and_leaves_no_staging_dir(
    mounted_out, monkeypatch, capsys, tiny_llama, conversations, stage
):
    """When the finished output cannot be renamed into place: one line with the cause, no .staging dir, old
    output kept."""
    args = {
        "prepare": ["--data", conversations, "--model", tiny_llama, "--seq-length", 64],
        "weights": ["--model", tiny_llama],
    }[stage]
    refused(
        cli(monkeypatch, capsys, stage, *args, "--out", mounted_out, "--overwrite"),
        "cannot move the finished output into place",
        os.strerror(16),
    )
    assert not list(mounted_out.parent.glob(".out.staging-*")) and not list(
        mounted_out.parent.glob(".out.old-*")
    )
    assert (mounted_out / "old-output.txt").read_text() == "previous run\n"


def test_output_checks_run_in_a_real_process(tmp_path, tiny_llama):
    """Across a real process: weights --out MODEL --overwrite is one stderr line, exit 2, the model intact."""
    model = linked_copy(tiny_llama, tmp_path / "model")
    before = _tree(model)
    proc = subprocess.run(
        [PYTHON, "-m", "pipeline", "weights", "--model", str(model), "--out", str(model), "--overwrite"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "destroy an input" in proc.stderr, (
        proc.stderr
    )
    assert _tree(model) == before


def _train_args(inputs, out, *flags):
    return [
        "train",
        "--data",
        inputs.data,
        "--verifier",
        inputs.verifier,
        "--prepared",
        inputs.prepared,
        "--model",
        inputs.model,
        "--out",
        out,
        "--device",
        "cpu",
        "--epochs",
        "1",
        "--max-len",
        "128",
        "--num-workers",
        "0",
        "--no-eval",
        "--no-plots",
        *flags,
    ]


TRAIN_OVERLAPS = {
    # case: (which input, how, flags)
    "train-out-is-data": ("data", "is", ["--overwrite"]),
    "train-out-is-verifier": ("verifier", "is", ["--overwrite"]),
    "train-out-is-model": ("model", "is", ["--resume"]),
    "train-out-is-prepared": ("prepared", "is", ["--overwrite"]),
    "train-out-contains-data": ("data", "contains", ["--overwrite"]),
    "train-out-inside-verifier": ("verifier", "inside", []),
}


@pytest.mark.parametrize("case", sorted(TRAIN_OVERLAPS))
def test_train_output_overlapping_an_input_is_refused(tmp_path, monkeypatch, capsys, case):
    """train --out equal to, containing or inside its hidden states, verifier, model or prepared dir: one line
    naming the input, exit 2, before anything is deleted or written; every input's tree unchanged."""
    from tests.train.conftest import write_inputs

    inputs = write_inputs(tmp_path / "inputs", samples=8)
    victim, how, flags = TRAIN_OVERLAPS[case]
    target = getattr(inputs, victim)
    out = {"is": target, "contains": target.parent, "inside": target / "sub"}[how]
    before = _tree(tmp_path / "inputs")
    refused(
        cli(monkeypatch, capsys, *_train_args(inputs, out, *flags)),
        "writing there would destroy an input",
        f"--{victim}",
    )
    assert _tree(tmp_path / "inputs") == before


def test_second_train_into_one_output_is_refused_naming_the_holder(holder, tmp_path, monkeypatch, capsys):
    """While another process holds the output's lock, train into it is refused naming the holder; nothing
    written."""
    from tests.train.conftest import write_inputs

    out, proc = holder
    inputs = write_inputs(tmp_path / "inputs", samples=8)
    refused(
        cli(monkeypatch, capsys, *_train_args(inputs, out)),
        f"is being written by pid {proc.pid}",
        "wait for it to finish",
    )
    assert not out.exists()
