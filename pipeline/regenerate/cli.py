"""``pipeline regenerate``: the command line of the regenerate stage."""

from __future__ import annotations

import click

from pipeline.options import options
from pipeline.regenerate.config import RegenerateConfig


@click.command("regenerate")
@options(RegenerateConfig)
def command(**kwargs) -> None:
    """Rewrite the assistant turns of conversations with the target's own answers, through its chat server."""
    from pipeline.regenerate.stage import check, run

    cfg = RegenerateConfig(**kwargs)
    if cfg.check:  # the checks alone, one line each (what ops' preflight runs before the stage)
        check(cfg, say=click.echo)
        return
    s = run(cfg)
    by = ", ".join(f"{n} {r}" for r, n in s["rejected_by_reason"].items() if n)
    click.echo(
        f"regenerated {s['kept']} of {s['rows']} rows ({s['rejected']} rejected{': ' + by if by else ''}), "
        f"{s['completion_tokens']} tokens at {s['output_tokens_per_s']} tok/s "
        f"-> {kwargs['out']}/conversations.jsonl"
    )
