"""``python -m pipeline``: the command line of every stage.

Owns argument parsing and the translation of StageError into a one-line message and an exit code.
Each stage's command lives in its own module and is imported only when invoked (``pipeline --help`` lists
the commands from their summaries here), so that ``pipeline verify`` never pays for importing vLLM and
``--help`` is instant.
"""

from __future__ import annotations

import copy
import errno
import functools
import importlib
import os
import signal
import sys

import click

from pipeline.errors import StageError

# transformers 5 draws a "Loading weights" progress bar on stderr at every model load (it reads this flag of
# huggingface_hub at import): a stage's stderr is its one-line error, and stages report their own progress
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# command name -> "module:attribute" of a click.Command
COMMANDS = {
    "prepare": "pipeline.prepare:command",
    "extract": "pipeline.extract.cli:command",
    "weights": "pipeline.weights:command",
    "verify": "pipeline.verify:command",
    "preflight": "pipeline.preflight:command",
    "train": "pipeline.train.cli:command",
    "demo-assets": "pipeline.demo.run:assets_command",
    "check-args": "pipeline.argcheck:command",
    "export-speculators": "pipeline.interop:export_command",
    "import-speculators": "pipeline.interop:import_command",
    "regenerate": "pipeline.regenerate.cli:command",
    "evaluate": "pipeline.evaluate:command",
}

# commands the pipeline starts itself, never listed: the data-parallel extract's workers
INTERNAL = {"extract-worker": "pipeline.extract.cli:worker_command"}


# command name -> the first paragraph of its command's docstring: what `pipeline --help` lists it with, so
# that the list imports no stage module (tests/pipeline/test_cli_imports.py holds each equal to its command's)
SUMMARIES = {
    "prepare": "Tokenize conversations with the target's chat template; loss mask on assistant tokens only.",
    "extract": "Capture the outputs of 4 decoder layers for every prepared sample.",
    "weights": "Extract the verifier's embed_tokens, final norm and lm_head without loading the model.",
    "verify": "Check any stage's output; write PATH/summary.json; exit non-zero on a failed check.",
    "preflight": "Check model, data, devices, disk and the installed vLLM before any model load.",
    "train": "Train an EAGLE-3 draft with speculators; measure its offline acceptance against trivial "
    "baselines.",
    "demo-assets": "Build a tiny model (OUT/model) and conversations (OUT/conversations.jsonl) for it.",
    "check-args": "Parse ARGS as `pipeline STAGE` would; invoke nothing.",
    "export-speculators": "Write what `speculators train` reads (Arrow dataset + "
    "hidden_states/hs_{i}.safetensors) from our set.",
    "regenerate": "Rewrite the assistant turns of conversations with the target's own answers, through its "
    "chat server.",
    "evaluate": "Measure a draft in vLLM: acceptance, decode speed, greedy equality vs. none and n-gram "
    "lookup.",
    "import-speculators": "Write our prepared + hidden-states dirs (what `pipeline train` reads) from a "
    "speculators data dir.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's own command list, made from SUMMARIES (each shortened as click shortens a docstring)."""
        stand_ins = {name: click.Command(name, help=text) for name, text in SUMMARIES.items()}
        click.Group.format_commands(click.Group(commands=stand_ins), ctx, formatter)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name) or INTERNAL.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        command = getattr(importlib.import_module(module), attr)
        return closed_by(command, closing_verify) if name == "extract" else command


def closed_by(command: click.Command, closing) -> click.Command:
    """A copy of ``command`` whose run ends with ``closing``, handed what the command's callback returned
    (the callback's attributes kept: check-args reads its config from them)."""
    inner = command.callback

    @functools.wraps(inner)
    def callback(**kwargs):
        return closing(inner(**kwargs))

    composed = copy.copy(command)
    composed.callback = callback
    return composed


def closing_verify(written) -> None:
    """extract's closing check: the verify stage on the set the run just wrote (``written``: the ExtractConfig
    extract returns; None, or --no-verify, for none). Composed here so that the extract package, a library
    under the stages, never imports the verify stage."""
    if written is None or not written.verify:
        return
    from pipeline import verify

    verify.report(
        verify.VerifyConfig(
            path=written.out,
            world_size=written.world_size,
            rank=written.rank,
            closing_check=written.closing_check,
        )
    )


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """EAGLE-3 data pipeline: prepare -> extract -> weights -> train, and verify any output."""


_INTERRUPTED = []  # a SIGINT arrived (Ctrl-C, or `docker stop`'s first signal as ops sends it)


def _on_sigint(signum, frame) -> None:
    """Python's own Ctrl-C (KeyboardInterrupt), remembered: a library that catches the KeyboardInterrupt and
    raises its own error instead (pydantic while a checkpoint's config is serialized) must not turn an
    interrupted run into a traceback and exit 1."""
    _INTERRUPTED.append(signum)
    signal.default_int_handler(signum, frame)


def run() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # nobody else's handler replaced
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        main(standalone_mode=False)
    except StageError as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        # a flag click itself refuses (a missing option, a value outside a choice or range): the one line
        # every other refusal is, with where to read the usage instead of the usage block
        names, ctx = [], exc.ctx
        while ctx is not None and ctx.parent is not None:  # the stage's name; the root is always ours
            names.insert(0, ctx.info_name)
            ctx = ctx.parent
        where = " ".join(["python -m pipeline", *names])
        message = " ".join(exc.format_message().split())
        click.secho(f"error: {message} (see `{where} --help`)", fg="red", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:
        # a file operation outside the paths that already explain themselves (a full disk while writing
        # the last index file, a read-only output): one line, not a traceback; writes are atomic, so
        # nothing half-written is left
        click.secho(f"error: {os_error_line(exc)}", fg="red", err=True)
        sys.exit(2)
    except Exception:
        if _INTERRUPTED:  # the KeyboardInterrupt came back as another error: interrupted all the same
            click.echo("aborted", err=True)
            sys.exit(130)
        raise


def os_error_line(exc: OSError) -> str:
    """`<what> <path>: <reason> (<what to do>)` for an OSError that reached the top."""
    where = f" {exc.filename}" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free space, then re-run (extract: with --resume, which keeps the files already written)"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = "choose an output path this user can write"
    else:
        hint = "check the path, then re-run"
    return f"file operation failed{where}: {exc.strerror or exc} ({hint})"
