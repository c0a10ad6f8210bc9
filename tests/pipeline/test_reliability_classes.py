"""The classes of issue #32, each at its cause: text no encoder takes, a `messages` that is not a list, a full
disk while a stage writes, a symlink loop on any path option, a data_config.json naming no dtype, numbers
outside their range on every option, click's own refusals: one line `error: ...` naming what is wrong and
what to do, exit 2 (verify: a failed check, exit 3), nothing written, deleted or left beside the output."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import typing
from pathlib import Path

import pytest

from tests.conftest import run_pipeline, tmpfs
from tests.pipeline.test_reliability_readers import cli, refused


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (hidden ones too), its size and mtime: what "nothing changed" compares."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------- conversation rows


def _row(**turn_fields) -> dict:
    user = {"role": "user", "content": "hello"}
    assistant = {"role": "assistant", "content": "hi"}
    for key, value in turn_fields.items():
        (assistant if key.startswith("a_") else user)[key[2:]] = value
    return {"messages": [user, assistant]}


# a lone surrogate wherever the chat template may read text: json.dumps writes it as the escape it came as
SURROGATES = {
    "user-content": _row(u_content="say \ud800 please"),
    "assistant-content-low-half": _row(a_content="\udc80"),
    "reasoning": _row(a_reasoning_content="think \udfff"),
    "tool-call-arguments": _row(
        a_content=None, a_tool_calls=[{"function": {"name": "f", "arguments": {"q": "\ud83d"}}}]
    ),
}


@pytest.mark.parametrize("case", sorted(SURROGATES))
def test_text_no_encoder_takes_is_named_by_line(tmp_path, monkeypatch, capsys, tiny_llama, case):
    """A lone UTF-16 surrogate (valid JSON, no valid text) in any string a turn hands the template: the row
    is named by line with the surrogate, exit 2, nothing written (before: the tokenizer's TypeError)."""
    data = tmp_path / "rows.jsonl"
    good = json.dumps(_row())
    data.write_text(good + "\n" + json.dumps(SURROGATES[case]) + "\n")
    out = tmp_path / "p"
    refused(
        cli(monkeypatch, capsys, "prepare", "--data", data, "--model", tiny_llama, "--out", out),
        f"{data}:2:",
        "lone UTF-16 surrogate",
        "--skip-invalid",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_text_no_encoder_takes_is_skipped_with_skip_invalid(tmp_path, monkeypatch, capsys, tiny_llama):
    """With --skip-invalid such a row is counted as skipped and the others are prepared (control)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (_row(), SURROGATES["user-content"], _row())) + "\n")
    rc, err = cli(
        monkeypatch, capsys, "prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p",
        "--skip-invalid", "--seq-length", "64",
    )  # fmt: skip
    assert rc == 0, err
    meta = json.loads((tmp_path / "p" / "metadata.json").read_text())
    assert meta["num_samples"] == 2 and meta["skipped_rows"] == 1


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ({"messages": "hello"}, "'messages' is a JSON string, expected a list of turns"),
        ({"messages": {"role": "user"}}, "'messages' is a JSON object, expected a list of turns"),
        ({"messages": 3}, "'messages' is a JSON number"),
        ({"messages": None}, "'messages' is a JSON null"),
        ({"conversations": True}, "'conversations' is a JSON boolean"),
        ({"messages": []}, "conversation is empty"),
    ],
)
def test_a_turn_list_that_is_not_a_list_is_named_as_such(
    tmp_path, monkeypatch, capsys, tiny_llama, row, fragment
):
    """`messages` (or `conversations`) of another JSON kind is named with its kind, not as an empty
    conversation; an empty list still is one (control)."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    refused(
        cli(monkeypatch, capsys, "prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p"),
        f"{data}:1: {fragment}",
    )
    assert not (tmp_path / "p").exists()


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 64 KiB: a file system a stage's output does not fit in."""
    with tmpfs(tmp_path / "disk", "64k") as mnt:
        yield mnt


def test_full_disk_in_weights_is_one_line_naming_the_output(small_disk, tiny_llama):
    """weights whose verifier.safetensors (1 MiB) does not fit: a real process ends in one line naming the
    output and "No space left on device", exit 2; nothing is left on the full disk, no staging dir and no
    lock file (before: safetensors' SafetensorError traceback, and `.v.lock` left behind)."""
    out = small_disk / "v"
    proc = run_pipeline("weights", "--model", tiny_llama, "--out", out)
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert str(out) in err and "disk full: No space left on device" in err and "free space" in err, err
    assert list(small_disk.iterdir()) == []


def test_full_disk_in_prepare_names_the_file(tmp_path, monkeypatch, capsys, tiny_llama, conversations):
    """prepare's files do not fit a 4 KiB tmpfs: the line names the output's file (not its staging name)
    and "No space left on device"; nothing is left there (before: a line naming no path)."""
    with tmpfs(tmp_path / "disk", "4k") as mnt:
        out = mnt / "p"
        rc, err = cli(
            monkeypatch, capsys, "prepare", "--data", conversations, "--model", tiny_llama, "--out", out,
            "--seq-length", "128", "--draft-vocab-size", "64",
        )  # fmt: skip
        refused((rc, err), f"{out}/", "disk full: No space left on device")
        assert ".staging" not in err
        assert list(mnt.iterdir()) == []


def test_full_disk_in_train_is_one_line_and_leaves_no_output(
    tmp_path, small_disk, tiny_llama, extracted_llama
):
    """train into a 64 KiB tmpfs (a real process): one line naming the file it could not write and "No space
    left on device", exit 2; the --out this run created is gone with its lock file, as no epoch finished
    (before: --out left half-written)."""
    from pipeline.weights import run as weights

    weights(tiny_llama, tmp_path / "v")
    out = small_disk / "tr"
    proc = run_pipeline(
        "train", "--data", extracted_llama, "--verifier", tmp_path / "v", "--out", out,
        "--epochs", "1", "--no-eval", "--no-plots", "--max-len", "64",
    )  # fmt: skip
    err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert err.startswith(f"error: file operation failed {out}/") and "disk full: No space left" in err, err
    assert "Traceback" not in proc.stderr, proc.stderr
    assert list(small_disk.iterdir()) == []


def test_how_a_failed_write_is_named():
    """A library's full-disk error becomes ENOSPC naming the file, and any full disk reads "disk full"; an
    OSError without a file gets it; a stage's own one line (extract's "... re-run with --resume", whatever its
    text) and Ctrl-C pass unchanged."""
    from pipeline.errors import StageError
    from pipeline.ondisk.atomic import write_error

    wrapped = write_error(RuntimeError("I/O error: No space left on device (os error 28)"), "/o/f")
    assert isinstance(wrapped, OSError) and wrapped.errno == 28 and wrapped.filename == "/o/f"
    bare = write_error(OSError(13, "Permission denied"), "/o/f")
    assert bare.errno == 13 and bare.filename == "/o/f"
    full = write_error(OSError(28, "No space left on device", "/o/g"), "/o/f")  # names its file: kept
    assert full.filename == "/o/g" and full.strerror == "disk full: No space left on device"
    assert write_error(full, "/o/f") is None  # told once
    assert write_error(StageError("No space left on device; re-run with --resume"), "/o/f") is None
    assert write_error(KeyboardInterrupt(), "/o/f") is None
    assert write_error(ValueError("bad value"), "/o/f") is None


def test_a_finished_writer_leaves_no_lock_file_and_a_second_one_still_locks(tmp_path):
    """The lock file beside an output goes once its holder lets go, and a second writer is still refused
    while it is held; a writer left with an fd of a removed lock file holds no lock anyone else sees (what
    `_locked` checks after its flock, before it counts a lock as taken)."""
    from pipeline.errors import StageError
    from pipeline.ondisk.outdir import lock_path, output_lock

    out = tmp_path / "out"
    with output_lock(out):
        assert lock_path(out).is_file()
        with pytest.raises(StageError, match="is being written by pid"):
            with output_lock(out):
                pass
    assert not lock_path(out).exists()
    stale = os.open(lock_path(out), os.O_RDWR | os.O_CREAT)  # a writer that opened the file, then paused
    try:
        with output_lock(out):  # takes and, on leaving, removes that file
            pass
        with output_lock(out):  # a new file: the paused writer's fd names a removed one
            import fcntl

            fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it gets a lock of a file nobody sees...
            assert not os.path.samestat(os.fstat(stale), os.stat(lock_path(out)))  # ...which _locked refuses
    finally:
        os.close(stale)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- symlink loops


def _loop(tmp_path: Path) -> Path:
    a, b = tmp_path / "loop-a", tmp_path / "loop-b"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


PATH_OPTIONS = {
    # stage -> its path options -> the other arguments (None: the option takes the loop)
    "prepare": ("--data", "--model", "--out"),
    "extract": ("--prepared", "--model", "--out"),
    "weights": ("--model", "--out"),
    "verify": ("PATH", "--prepared", "--verifier", "--model"),
    "train": ("--data", "--verifier", "--out", "--prepared", "--model"),
}


def _stage_args(stage: str, tmp_path: Path, tiny_llama, conversations, prepared_llama, extracted_llama):
    return {
        "prepare": {"--data": conversations, "--model": tiny_llama, "--out": tmp_path / "out"},
        "extract": {"--prepared": prepared_llama, "--model": tiny_llama, "--out": tmp_path / "out"},
        "weights": {"--model": tiny_llama, "--out": tmp_path / "out"},
        "verify": {"PATH": extracted_llama},
        "train": {"--data": extracted_llama, "--verifier": tmp_path / "v", "--out": tmp_path / "out"},
    }[stage]


@pytest.mark.parametrize(
    ("stage", "flag"), [(stage, flag) for stage, flags in PATH_OPTIONS.items() for flag in flags]
)
@pytest.mark.parametrize("where", ["the-path", "a-parent"])
def test_symlink_loop_on_any_path_option_is_one_line(
    tmp_path,
    monkeypatch,
    capsys,
    tiny_llama,
    conversations,
    prepared_llama,
    extracted_llama,
    stage,
    flag,
    where,
):
    """A path option that is, or lies under, a symlink loop: one line naming the option, the path and the
    loop, exit 2, before anything is written (before: prepare and extract ended in "RuntimeError: Symlink
    loop")."""
    loop = _loop(tmp_path)
    bad = loop if where == "the-path" else loop / "x" / "y"
    args = _stage_args(stage, tmp_path, tiny_llama, conversations, prepared_llama, extracted_llama)
    args[flag] = bad
    words = [str(args.pop("PATH"))] if "PATH" in args else []
    for key, value in args.items():
        words += [key, str(value)]
    before = tree(extracted_llama)
    refused(cli(monkeypatch, capsys, stage, *words), f"{bad}: a symlink loop", "fix or remove the link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop-a", "loop-b"]
    assert tree(extracted_llama) == before


@pytest.mark.parametrize(
    "words",
    [
        ["preflight", "--model", "LOOP"],
        ["preflight", "--model", "MODEL", "--out", "LOOP/x"],
        ["export-speculators", "--prepared", "LOOP", "--data", "LOOP", "--out", "OUT"],
        ["import-speculators", "--data", "LOOP", "--out", "OUT"],
        ["demo-assets", "--out", "LOOP/x"],
    ],
)
def test_symlink_loop_in_the_hand_written_commands(tmp_path, monkeypatch, capsys, tiny_llama, words):
    """The commands whose options are written by hand take the same path type: one line, nothing written."""
    loop = _loop(tmp_path)
    subst = {
        "LOOP": str(loop),
        "MODEL": str(tiny_llama),
        "OUT": str(tmp_path / "out"),
        "LOOP/x": str(loop / "x"),
    }
    refused(cli(monkeypatch, capsys, *[subst.get(w, w) for w in words]), "a symlink loop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop-a", "loop-b"]


def test_resolve_of_a_loop_is_one_line_in_code_paths_too(tmp_path):
    """A config built in code (a data-parallel worker's) meets the same refusal as the command line."""
    from pipeline.errors import StageError
    from pipeline.ondisk.outdir import refuse_overlap
    from pipeline.prepare import PrepareConfig

    loop = _loop(tmp_path)
    with pytest.raises(StageError, match="--out .*: a symlink loop"):
        PrepareConfig(data=tmp_path, model=tmp_path, out=loop / "o")
    with pytest.raises(StageError, match="a symlink loop"):
        refuse_overlap(loop / "o", {"--model": tmp_path})


# ---------------------------------------------------------------- data_config.json values


DATA_CONFIGS = {
    "unknown-dtype": ({"dtype": "float99"}, "dtype 'float99' is not one of"),
    "dtype-naming-a-torch-module": ({"dtype": "nn"}, "dtype 'nn' is not one of"),
    "dtype-empty": ({"dtype": ""}, "dtype '' is not one of"),
    "hidden-size-zero": ({"hidden_size": 0}, "hidden_size 0 is not an integer >= 1"),
    "layer-ids-negative": ({"layer_ids": [-1, 2, 3, 4]}, "layer_ids [-1, 2, 3, 4] are not distinct"),
    "layer-ids-repeated": ({"layer_ids": [2, 2, 3, 4]}, "are not distinct"),
    "num-samples-negative": ({"num_samples": -5}, "num_samples -5 is not an integer >= 0"),
}


@pytest.mark.parametrize("case", sorted(DATA_CONFIGS))
def test_data_config_without_a_meaning_fails_verify_and_resume_by_name(
    states, monkeypatch, capsys, tiny_llama, prepared_llama, case
):
    """A data_config.json of the right types but no meaning (a dtype name torch does not have, a zero size):
    verify fails check data_config naming the field (exit 3; before: AttributeError traceback for the
    dtype), `extract --resume` refuses in one line, and nothing in the directory changes."""
    change, fragment = DATA_CONFIGS[case]
    path = states / "data_config.json"
    raw = json.loads(path.read_text())
    raw.update(change)
    path.write_text(json.dumps(raw))
    rc, err = cli(monkeypatch, capsys, "verify", states)
    refused((rc, err), "data_config", str(path), fragment, code=3)
    (states / "summary.json").unlink(missing_ok=True)
    before = tree(states)
    refused(
        cli(
            monkeypatch,
            capsys,
            "extract",
            "--prepared",
            prepared_llama,
            "--model",
            tiny_llama,
            "--out",
            states,
            "--resume",
            "--no-progress",
        ),  # fmt: skip
        str(path),
        fragment,
    )
    assert tree(states) == before


# ---------------------------------------------------------------- numbers


TRAIN_NUMBERS = {
    "max-len-0": (["--max-len", "0"], "--max-len 0 is outside the allowed range (at least 2)"),
    "lr-nan": (["--lr", "nan"], "--lr nan is outside the allowed range (greater than 0)"),
    "lr-inf": (["--lr", "inf"], "--lr inf is outside"),
    "lr-0": (["--lr", "0"], "--lr 0.0 is outside"),
    "lr-negative": (["--lr", "-1e-4"], "--lr -0.0001 is outside"),
    "epochs-0": (["--epochs", "0"], "--epochs 0 is outside"),
    "eval-fraction-1": (["--eval-fraction", "1"], "--eval-fraction 1.0 must be below 1"),
    "eval-fraction-nan": (["--eval-fraction", "nan"], "--eval-fraction nan is outside"),
    "seed-negative": (["--seed", "-1"], "--seed -1 is outside"),
    "seed-over-32-bits": (["--seed", str(2**32)], "--seed 4294967296 is outside"),
    "num-workers-negative": (["--num-workers", "-2"], "--num-workers -2 is outside"),
    "decay-nan": (["--ttt-step-loss-decay", "nan"], "--ttt-step-loss-decay nan is outside"),
    "warmup-negative": (["--warmup-steps", "-1"], "--warmup-steps -1 is outside"),
    "eval-k-0": (["--eval-k", "0"], "--eval-k 0 is outside"),
    "stop-after-0": (["--stop-after-epochs", "0"], "--stop-after-epochs 0 is outside"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_NUMBERS))
def test_train_numbers_outside_their_range_write_nothing(
    tmp_path, monkeypatch, capsys, extracted_llama, case
):
    """train's numbers out of range (a maximum length of 0, a NaN learning rate, ...): one line with the
    allowed range, exit 2, and no --out (before: a traceback, and --out half-written)."""
    flags, fragment = TRAIN_NUMBERS[case]
    out = tmp_path / "out"
    words = ["--data", extracted_llama, "--verifier", tmp_path / "v", "--out", out, *flags]
    refused(cli(monkeypatch, capsys, "train", *words), fragment)
    assert not out.exists()


def test_every_number_of_every_stage_has_a_declared_range():
    """Every int and float option of every stage config declares its allowed range (or is checked by its
    stage at construction, listed here): the class behind "a maximum length of 0" is an option nobody
    bounded, so a new one fails here."""
    from pipeline.cli import COMMANDS
    from pipeline.options import _base_type, config_of, spec_of

    # checked in the config's __post_init__ or against the model before any output: (stage, field)
    checked_elsewhere = {
        ("prepare", "draft_vocab_size"),  # 1..the target's vocab size, read from config.json
        ("extract", "max_batch_tokens"),
        ("extract", "max_batch_size"),
        ("extract", "writer_threads"),
        ("extract", "data_parallel"),
        ("extract", "world_size"),
        ("extract", "rank"),
        ("verify", "rank"),
        ("train", "states_memory_share"),  # (0, 1) exclusive: pipeline/train/share.py check_share
    }
    unbounded = []
    for stage, target in COMMANDS.items():
        module, attr = target.split(":")
        cls = config_of(getattr(importlib.import_module(module), attr))
        if cls is None:
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            spec = spec_of(f)
            if _base_type(hints[f.name]) in (int, float) and spec.cli and spec.low is None:
                if (stage, f.name) not in checked_elsewhere:
                    unbounded.append(f"{stage} --{f.name.replace('_', '-')}")
    assert not unbounded, unbounded


@pytest.mark.parametrize(
    ("words", "fragment"),
    [
        (["verify", "PATH", "--recompute-tolerance", "nan"], "nan is not in the range x>0"),
        (["verify", "PATH", "--recompute-tolerance", "inf"], "inf is not in the range x>0"),
        (["verify", "PATH", "--alignment-samples", "x"], "'x' is not a valid integer"),
        (["verify"], "Missing argument 'PATH'"),
        (["prepare", "--nope"], "No such option '--nope'"),
        (["no-such-stage"], "No such command 'no-such-stage'"),
    ],
)
def test_click_refusals_are_one_line(tmp_path, monkeypatch, capsys, words, fragment):
    """What click itself refuses (a range click checks, a missing argument, an unknown option) is one line
    too, pointing at --help instead of printing the usage block; a NaN or infinite value is out of any
    range (before: click's FloatRange let NaN through every bound)."""
    words = [str(tmp_path) if w == "PATH" else w for w in words]
    where = "python -m pipeline" + (f" {words[0]}" if words[0] != "no-such-stage" else "")
    refused(cli(monkeypatch, capsys, *words), fragment, f"(see `{where} --help`)")


def test_a_symlink_loop_through_the_real_command_line(tmp_path, tiny_llama):
    """Through a real process: one stderr line, exit 2, no traceback."""
    loop = _loop(tmp_path)
    proc = run_pipeline("weights", "--model", tiny_llama, "--out", loop / "v")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "symlink loop" in proc.stderr, (
        proc.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop-a", "loop-b"]


# ---------------------------------------------------------------- a train run's own files, read by verify


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_llama, extracted_llama):
    """One epoch of train on the session's extract, with its acceptance measured (eval.json)."""
    from pipeline.weights import run as weights

    root = tmp_path_factory.mktemp("trained")
    weights(tiny_llama, root / "v")
    run_pipeline(
        "train", "--data", extracted_llama, "--verifier", root / "v", "--out", root / "run",
        "--epochs", "1", "--no-plots", "--max-len", "64", "--eval-max-samples", "2", check=True,
    )  # fmt: skip
    return root / "run"


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("summary.json", "[1", "summary.json: not valid JSON"),
        ("train_config.json", "[1]", "train_config.json: is a JSON array, expected an object"),
        ("eval.json", '{"draft": 3}', "eval.json lacks the acceptance figures"),
    ],
)
def test_damaged_train_run_files_fail_verify_by_name(
    tmp_path, monkeypatch, capsys, trained_run, name, content, fragment
):
    """verify of a train run whose summary.json, train_config.json or eval.json is damaged: a failed check
    naming the file, exit 3 (before: JSONDecodeError / AttributeError / TypeError tracebacks)."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / name).write_text(content)
    refused(cli(monkeypatch, capsys, "verify", run), fragment, code=3)
