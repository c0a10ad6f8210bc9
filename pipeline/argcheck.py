"""``pipeline check-args STAGE ARGS...``: whether a stage would accept its command line, without running it.

Owns nothing but the parse: the stage's own click command parses ARGS exactly as ``pipeline STAGE ARGS``
would (unknown or misspelt options, missing required ones, values of the wrong type or outside a choice),
then, for a stage whose options come from its config dataclass (pipeline/options.py), builds that config,
so that a value outside its range is refused here too; nothing is invoked, so no model, data file or device
is touched. The ops preflight runs it inside the image before anything on the GPU host is stopped: alone for
a stage without a model preflight, else as the first check of ``pipeline preflight -- STAGE ARGS`` (one
process). Output: one line ``ok arguments: ...`` (exit 0), or ``FAIL arguments: <what click or the config
says>`` (exit 2).
"""

from __future__ import annotations

import dataclasses
import sys

import click

from pipeline.checks import CheckResult, fail, ok


def stage_args_check(stage: str, args: tuple[str, ...]) -> CheckResult:
    """``arguments``: ok when ``pipeline STAGE ARGS`` would accept its command line, else fail naming what
    click or the stage's config refused. The stage's module is imported for its click command (the stage
    modules keep torch out of their top level, so this imports none)."""
    from pipeline.cli import COMMANDS, main
    from pipeline.errors import StageError
    from pipeline.options import config_of

    if stage not in COMMANDS or stage == "check-args":
        return fail("arguments", f"unknown stage {stage!r}; one of {', '.join(sorted(COMMANDS))}")
    cmd = main.get_command(click.Context(main), stage)
    try:
        with cmd.make_context(f"pipeline {stage}", list(args), resilient_parsing=False) as ctx:
            if (config := config_of(cmd)) is not None:  # its fields (a command may add its own flags)
                names = {f.name for f in dataclasses.fields(config)}
                config(**{k: v for k, v in ctx.params.items() if k in names})
    except click.UsageError as exc:  # BadParameter, NoSuchOption, MissingParameter are UsageErrors
        return fail("arguments", f"pipeline {stage}: {exc.format_message()}")
    except click.exceptions.Exit:  # --help printed the help text: that is no run
        return fail("arguments", f"pipeline {stage}: --help shows the help text instead of running the stage")
    except StageError as exc:  # the config refused a value (a range, two options that contradict)
        return fail("arguments", f"pipeline {stage}: {exc}")
    return ok("arguments", f"pipeline {stage} accepts its {len(args)} argument(s)")


@click.command("check-args", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("stage")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(stage: str, args: tuple[str, ...]) -> None:
    """Parse ARGS as `pipeline STAGE` would; invoke nothing."""
    result = stage_args_check(stage, args)
    click.echo(f"{'FAIL' if result.failed else 'ok  '} {result.name}: {result.detail}")
    if result.failed:
        sys.exit(2)
