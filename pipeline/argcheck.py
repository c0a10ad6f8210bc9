"""``pipeline check-args STAGE ARGS...``: whether a stage would accept its command line, without running it.

Owns nothing but the parse: the stage's own click command parses ARGS exactly as ``pipeline STAGE ARGS``
would (unknown or misspelt options, missing required ones, values of the wrong type or outside a choice),
then, for a stage whose options come from its config dataclass (pipeline/options.py), builds that config,
so that a value outside its range is refused here too; nothing is invoked, so no model, data file or device
is touched. The ops preflight runs it inside the image before anything on the GPU host is stopped. Output:
one line ``ok arguments: ...`` (exit 0), or ``FAIL arguments: <what click or the config says>`` (exit 2).
"""

from __future__ import annotations

import dataclasses
import sys

import click


@click.command("check-args", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("stage")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(stage: str, args: tuple[str, ...]) -> None:
    """Parse ARGS as `pipeline STAGE` would; invoke nothing."""
    from pipeline.cli import COMMANDS, main
    from pipeline.errors import StageError
    from pipeline.options import config_of

    if stage not in COMMANDS or stage == "check-args":
        click.echo(f"FAIL arguments: unknown stage {stage!r}; one of {', '.join(sorted(COMMANDS))}")
        sys.exit(2)
    cmd = main.get_command(click.Context(main), stage)
    try:
        with cmd.make_context(f"pipeline {stage}", list(args), resilient_parsing=False) as ctx:
            if (config := config_of(cmd)) is not None:  # its fields (a command may add its own flags)
                names = {f.name for f in dataclasses.fields(config)}
                config(**{k: v for k, v in ctx.params.items() if k in names})
    except click.UsageError as exc:  # BadParameter, NoSuchOption, MissingParameter are UsageErrors
        click.echo(f"FAIL arguments: pipeline {stage}: {exc.format_message()}")
        sys.exit(2)
    except click.exceptions.Exit:  # --help printed the help text: that is no run
        click.echo(
            f"FAIL arguments: pipeline {stage}: --help shows the help text instead of running the stage"
        )
        sys.exit(2)
    except StageError as exc:  # the config refused a value (a range, two options that contradict)
        click.echo(f"FAIL arguments: pipeline {stage}: {exc}")
        sys.exit(2)
    click.echo(f"ok   arguments: pipeline {stage} accepts its {len(args)} argument(s)")
