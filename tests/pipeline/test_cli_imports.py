"""A command that only shows help or refuses its arguments never imports torch (issue #16): each case is a
real ``python -X importtime -m pipeline ...`` process, and its import log must hold no ``torch`` module;
``pipeline --help`` imports no stage module at all (its list comes from pipeline/cli.py's SUMMARIES)."""

from __future__ import annotations

import os
import re
import subprocess

import click
import pytest

from pipeline.cli import COMMANDS, SUMMARIES, main
from tests.conftest import PYTHON, REPO

# a line of -X importtime's log naming torch or one of its submodules (`import time: 12 | 34 |   torch.nn`)
TORCH_LINE = re.compile(r"^import time:.*\|\s+torch(\.\w+)*\s*$", re.MULTILINE)
MODULE_LINE = re.compile(r"^import time:.*\|\s+([\w.]+)\s*$", re.MULTILINE)

EXTRACT = ("check-args", "extract", "--prepared", "p", "--model", "m", "--out", "o")
# (argv, the exit code it has): the check-args refusals the ops preflight meets, one per way to be refused
REFUSALS = [
    (("check-args", "prepare", "--seq-length", "1"), 2),  # a required option missing
    (("check-args", "prepare", "--data", "d", "--model", "m", "--out", "o", "--seq-length", "1"), 2),  # range
    ((*EXTRACT, "--layer-id", "1"), 2),  # an unknown option
    ((*EXTRACT, "--backend", "x"), 2),  # a value outside a choice
    (("check-args", "verify", "p", "--world-size", "2", "--rank", "2"), 2),  # two fields joined
    (("check-args", "train", "--data", "d", "--verifier", "v", "--out", "o", "--epochs", "0"), 2),
    (("check-args", "nosuch"), 2),
    (("check-args", "weights", "--help"), 2),
]
CASES = (
    [(("--help",), 0)]
    + [((stage, "--help"), 0) for stage in sorted(COMMANDS) if stage != "check-args"]
    + REFUSALS
)


def importtime_run(
    args: tuple[str, ...], code: int, run: tuple[str, ...] = ("-m", "pipeline")
) -> subprocess.CompletedProcess:
    """`python -X importtime -m pipeline ARGS`, which must exit with ``code``; its stderr holds the log."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run(
        [PYTHON, "-X", "importtime", *run, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "import time:" in proc.stderr  # the log is there to be read
    return proc


def import_log(args: tuple[str, ...], code: int, run: tuple[str, ...] = ("-m", "pipeline")) -> str:
    """The -X importtime log of `python -m pipeline ARGS`, once the process exited with ``code``."""
    return importtime_run(args, code, run).stderr


def torch_lines(args: tuple[str, ...], code: int, run: tuple[str, ...] = ("-m", "pipeline")) -> list[str]:
    """The torch lines of the import log of `python -m pipeline ARGS` (see ``import_log``)."""
    return [m.group(0) for m in TORCH_LINE.finditer(import_log(args, code, run))]


@pytest.mark.parametrize(("args", "code"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_help_and_refusals_do_not_import_torch(args, code):
    """`pipeline --help`, every stage's --help and check-args' refusals finish without torch loaded."""
    assert torch_lines(args, code) == []


def test_the_import_log_shows_torch_where_it_is_loaded():
    """The check above can fail: importing the train loop (which needs torch at the top) shows torch lines."""
    assert torch_lines((), 0, run=("-c", "import pipeline.train.stage"))


def test_the_command_list_imports_no_stage_module():
    """`pipeline --help` lists every command without importing the module of any (nor numpy)."""
    imported = set(MODULE_LINE.findall(import_log(("--help",), 0)))
    stage_modules = {target.split(":")[0] for target in COMMANDS.values()}
    assert "pipeline.cli" in imported  # the log names modules as this test reads them
    assert imported & (stage_modules | {"numpy"}) == set()


def test_the_summaries_are_the_commands_own():
    """Each command's summary in pipeline/cli.py shortens, at every width, to what its own docstring does, so
    that the list `pipeline --help` prints is the one click would make from the commands themselves."""
    assert set(SUMMARIES) == set(COMMANDS)
    for name, text in SUMMARIES.items():
        real = main.get_command(click.Context(main), name)
        stand_in = click.Command(name, help=text)
        for limit in range(10, 200):
            assert stand_in.get_short_help_str(limit) == real.get_short_help_str(limit), (name, limit)


# `pipeline preflight` as the ops preflight container runs it (ops/stage.py preflight_script): one process
# that checks the stage's argv first, then the files, then what needs transformers/torch/vLLM
def container_preflight(model, prepared, out, *, flags=(), argv=(), fail_fast="any") -> tuple[str, ...]:
    paths = ("--prepared", str(prepared), "--model", str(model), "--out", str(out))
    return (
        "preflight",
        *paths,
        "--backend",
        "hf",
        *flags,
        "--fail-fast-on",
        fail_fast,
        "--",
        "extract",
        *paths,
        "--backend",
        "hf",
        *argv,
    )


REFUSED_BY_FILES = {  # failed check -> (preflight flags, stage argv) of a misconfiguration found in files
    "layer ids": (("--layer-ids", "0,1,2"), ("--layer-ids", "0,1,2")),
    "arguments": ((), ("--layer-id", "0,1,2,3")),
}


def _run(args: tuple[str, ...], code: int) -> tuple[str, list[str]]:
    """stdout and the torch lines of the import log of `python -X importtime -m pipeline ARGS`."""
    proc = importtime_run(args, code)
    return proc.stdout, [m.group(0) for m in TORCH_LINE.finditer(proc.stderr)]


@pytest.mark.parametrize("check", sorted(REFUSED_BY_FILES))
def test_container_preflight_refused_by_a_file_check_imports_no_torch(
    check, tiny_llama, prepared_llama, tmp_path
):
    """A misconfigured extract (layer ids the model lacks; an option extract does not know) is refused by
    the one preflight process with exit 3, naming the check, the tokenizer checks skipped and said so,
    and torch never imported."""
    flags, argv = REFUSED_BY_FILES[check]
    args = container_preflight(tiny_llama, prepared_llama, tmp_path / "states", flags=flags, argv=argv)
    stdout, torch = _run(args, 3)
    assert torch == []
    failed = [ln for ln in stdout.splitlines() if "s] fail " in ln]
    assert len(failed) == 1 and f"fail {check}: " in failed[0], stdout
    assert "warn skipped: tokenizer, chat template: not checked" in stdout
    assert "ok   model config" in stdout and "free disk" in stdout  # the other file checks still ran


def test_container_preflight_that_passes_imports_torch_for_the_tokenizer(
    tiny_llama, prepared_llama, tmp_path
):
    """The check above can fail: a run that passes loads the tokenizer (transformers imports torch) in the
    same process that checked the arguments."""
    args = container_preflight(tiny_llama, prepared_llama, tmp_path / "states")
    stdout, torch = _run(args, 0)
    assert torch
    assert "ok   arguments: pipeline extract accepts" in stdout and "ok   tokenizer: " in stdout
    assert "skipped" not in stdout


def test_a_failure_the_caller_tolerates_does_not_skip_the_tokenizer(tiny_llama, tmp_path):
    """prepare's preflight fails fast only on the checks prepare refuses on (ops: StageSpec.fatal): a
    checkpoint that disagrees with config.json (a warning for prepare) still has the tokenizer and chat
    template checked."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (model / "config.json").write_text(json.dumps(config))
    fatal = "arguments,model config,tokenizer,chat template,stage preflight"
    stdout, _ = _run(("preflight", "--model", str(model), "--backend", "hf", "--fail-fast-on", fatal), 3)
    assert "fail layer count: " in stdout
    assert "ok   tokenizer: " in stdout and "ok   chat template: " in stdout and "skipped" not in stdout
