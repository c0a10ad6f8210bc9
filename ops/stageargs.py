"""The operator's stage arguments (after `--`), read once where a stage plan is built.

Owns the one reading of click's rule for the options ops needs to know the value of: the last of a
repeated option wins, `--flag value` and `--flag=value` are the same, a missing value is an error, and a
bare `--` ends the options. `parse` turns the words into typed fields (StageArgs) that the plan, the
layout, the server flags and the preflight use; the words themselves go on to the stage unchanged. Not the
stage's own click command (pipeline/cli.py): ops never imports pipeline, and a word that only the stage
knows (`--limit 3`) passes through unread. A value that is itself one of the flags below is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ops.errors import ConfigError

INT_FLAGS = ("--tensor-parallel-size", "--data-parallel", "--world-size", "--rank")
STR_FLAGS = ("--backend", "--dtype", "--endpoint", "--served-model")


def last_values(argv: Iterable[str], flags: Iterable[str], *, where: str = "after `--`") -> dict[str, str]:
    """{flag: value} of each flag in argv that takes a value, by click's rule (the last one wins, `--flag
    V` or `--flag=V`); a flag as the last word, with no value, is a ConfigError."""
    words, wanted, out = list(argv), set(flags), {}
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            break
        name, eq, value = word.partition("=")
        if name in wanted:
            if not eq:
                if i + 1 >= len(words):
                    raise ConfigError(f"{name} {where} needs a value")
                value = words[i + 1]
                i += 1
            out[name] = value
        i += 1
    return out


@dataclass(frozen=True)
class StageArgs:
    """The operator's stage arguments as given (argv, passed on unchanged) and the values ops reads of them
    (None: not given)."""

    argv: tuple[str, ...] = ()
    backend: str | None = None
    tensor_parallel_size: int | None = None
    data_parallel: int | None = None
    dtype: str | None = None  # the stored states' dtype (auto: bf16 on a GPU); the disk estimate reads it
    world_size: int | None = None  # hosts sharing the stage (--world-size); multi-host runs set it per host
    rank: int | None = None
    endpoint: str | None = None  # a server-up stage's server URL (regenerate), instead of the hosts file's
    served_model: str | None = None  # ... and the model name it serves


def parse(argv: Iterable[str] = ()) -> StageArgs:
    """The typed StageArgs of the words after `--`; ConfigError for a value missing or not a whole number."""
    argv = tuple(argv)
    found = last_values(argv, (*INT_FLAGS, *STR_FLAGS))
    ints = {}
    for flag in INT_FLAGS:
        if flag in found:
            try:
                ints[flag] = int(found[flag])
            except ValueError:
                raise ConfigError(f"{flag} {found[flag]!r} after `--` must be a whole number") from None
    return StageArgs(
        argv,
        backend=found.get("--backend"),
        tensor_parallel_size=ints.get("--tensor-parallel-size"),
        data_parallel=ints.get("--data-parallel"),
        dtype=found.get("--dtype"),
        world_size=ints.get("--world-size"),
        rank=ints.get("--rank"),
        endpoint=found.get("--endpoint"),
        served_model=found.get("--served-model"),
    )
