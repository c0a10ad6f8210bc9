"""A stage's command-line options, made from its config dataclass: one default, one help text per field.

Owns the field declaration ``opt(...)`` (the default and, in the field's metadata, its help text, option
spelling, choices, allowed range, hidden or not on the command line), the click parameters made from those
fields (``options``: type from the annotation, ``--field-name`` from the field's name, required when the
field has no default, a flag for a bool), and the check of a constructed config against the same
declarations (``validate``, called from the config's ``__post_init__``), whose one-line errors are the
ones the command line gives: click's own text where click enforces a choice or a range, the pipeline's
``require_range`` text otherwise. Checks that join two fields, or need a file, stay with the stage.
A config also crosses to a child process as its fields (``to_json``/``from_json``), never as a command line.
Imports click and the standard library only, never torch: a config module's weight stays its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from pipeline.errors import StageError, require_range
from pipeline.model.layers import parse_int_list
from pipeline.ondisk.paths import LoopCheckedPath, check_path

KEY = "pipeline.options"


@dataclass(frozen=True)
class Spec:
    """How one config field appears on the command line, and what values it allows."""

    help: str | None = None
    decls: tuple[str, ...] = ()  # option spellings; default `--field-name` (`--x/--no-x` for a pair of flags)
    choices: tuple[str, ...] | None = None
    low: float | None = None  # allowed range, checked at construction (and by click, with click_range)
    high: float | None = None
    low_open: bool = False  # low itself is refused
    click_range: bool = False  # render the range as click's IntRange/FloatRange (its help shows `x>=0`)
    argument: bool = False  # a positional argument, not an option
    hidden: bool = False  # accepted, not shown in --help
    cli: bool = True  # False: set only by code, never on the command line


def opt(
    default: Any = dataclasses.MISSING,
    *,
    help: str | None = None,
    decls: tuple[str, ...] | str = (),
    **spec: Any,
) -> Any:
    """A config field with its default and command-line Spec (no default: a required option)."""
    decls = (decls,) if isinstance(decls, str) else tuple(decls)
    if "choices" in spec and spec["choices"] is not None:
        spec["choices"] = tuple(spec["choices"])
    return dataclasses.field(default=default, metadata={KEY: Spec(help=help, decls=decls, **spec)})


def spec_of(f: dataclasses.Field) -> Spec:
    return f.metadata.get(KEY, Spec())


def flag_of(f: dataclasses.Field) -> str:
    """The option a field is set by, as errors name it (`--seq-length`)."""
    decls = spec_of(f).decls
    return decls[0].split("/")[0] if decls else "--" + f.name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    """`int | None` -> int; `Path` -> Path."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner
    return annotation


class IntTuple(click.ParamType):
    """A ``tuple[int, ...]`` field on the command line: comma-separated integers (``2,16,29,31``, spaces
    allowed); an empty text is None (the field's default). Other text is the pipeline's one-line error (a
    StageError, as the stages' own checks give), not click's usage block."""

    name = "text"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, ...] | None:
        if value is None or isinstance(value, tuple):
            return value
        flag = param.opts[0] if param is not None and param.opts else "value"
        return tuple(ids) if (ids := parse_int_list(str(value), flag)) else None


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, which lets NaN through every bound (each comparison with NaN is false), with NaN
    and the infinities refused as out of the range."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not in the range {self._describe_range()}.", param, ctx)
        return rv


def _click_type(base: type, spec: Spec) -> click.ParamType | None:
    if typing.get_origin(base) is tuple:
        return IntTuple()
    if spec.choices is not None:
        return click.Choice(spec.choices)
    if spec.click_range:
        kind = click.IntRange if base is int else FiniteFloatRange
        extra = {"min_open": True} if spec.low_open else {}
        return kind(min=spec.low, max=spec.high, **extra)
    return {int: click.INT, float: click.FLOAT, str: click.STRING, Path: LoopCheckedPath()}.get(base)


def parameter(f: dataclasses.Field, annotation: Any) -> Callable:
    """The click decorator (option or argument) for one field."""
    spec, base = spec_of(f), _base_type(annotation)
    if spec.argument:
        return click.argument(f.name, type=_click_type(base, spec))
    has_default = f.default is not dataclasses.MISSING
    kwargs: dict[str, Any] = {"help": spec.help} if spec.help is not None else {}
    if spec.hidden:
        kwargs["hidden"] = True
    decls = spec.decls or ("--" + f.name.replace("_", "-"),)
    if base is bool and not any("/" in d for d in decls):
        # a single flag: `--x` turns a False default on; `--no-x` turns a True default off
        kwargs["is_flag"] = True
        if f.default:
            kwargs.update(flag_value=False, default=True)
    else:
        if base is not bool:
            kwargs["type"] = _click_type(base, spec)
        if not has_default:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
            if f.default is not None:
                kwargs["show_default"] = True
    name = () if decls == ("--" + f.name.replace("_", "-"),) else (f.name,)
    return click.option(*decls, *name, **kwargs)


def options(cls: type) -> Callable:
    """Decorator: the click parameters of every command-line field of the config dataclass ``cls``, in field
    order; the callback gets them as keyword arguments named like the fields (``cls(**kwargs)``)."""
    hints = typing.get_type_hints(cls)
    made = [parameter(f, hints[f.name]) for f in dataclasses.fields(cls) if spec_of(f).cli]

    def apply(fn: Callable) -> Callable:
        for make in reversed(made):
            fn = make(fn)
        fn.stage_config = cls  # pipeline check-args builds the config from the parsed words
        return fn

    return apply


def config_of(command: click.Command) -> type | None:
    """The config dataclass a command's options were made from (None: a hand-written command)."""
    return getattr(command.callback, "stage_config", None)


def validate(cfg: Any) -> None:
    """Refuse a value outside its field's choices or range in one line: click's text where click checks it,
    `require_range`'s otherwise; a path with a symlink loop on it (pipeline/ondisk/paths.py). None (not
    given) is always allowed."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        spec, value = spec_of(f), getattr(cfg, f.name)
        if isinstance(value, Path):
            check_path(value, flag_of(f))
        if value is None or (spec.choices is None and spec.low is None and spec.high is None):
            continue
        if spec.choices is not None or spec.click_range:
            try:
                _click_type(_base_type(hints[f.name]), spec).convert(value, None, None)
            except click.BadParameter as exc:
                raise StageError(f"Invalid value for '{flag_of(f)}': {exc.message}") from None
        else:
            low = spec.low if spec.low is not None else float("-inf")
            require_range(flag_of(f), value, low, spec.high, low_open=spec.low_open)


def to_json(cfg: Any) -> str:
    """Every field of a config as JSON (a path as its text, a tuple as a list): what ``from_json``
    rebuilds."""

    def plain(value: Any) -> Any:
        return str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value

    return json.dumps({f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})


def from_json(cls: type, text: str) -> Any:
    """The config ``to_json`` wrote, each field of its annotated type again, checked at construction as any
    other; a field the class does not have is refused (a launcher and a worker of two versions)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StageError(f"{cls.__name__} as JSON expected, got {text[:40]!r} ({exc.msg})") from None
    if not isinstance(data, dict):
        raise StageError(f"{cls.__name__} as a JSON object expected, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    unknown = sorted(set(data) - {f.name for f in fields})
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
    if unknown or missing:
        raise StageError(
            f"{cls.__name__}: no field {', '.join(unknown) or '-'}, missing {', '.join(missing) or '-'}"
            " (a launcher and a worker of different versions?)"
        )

    def typed(name: str, value: Any) -> Any:
        base = _base_type(hints[name])
        if value is None:
            return None
        return Path(value) if base is Path else tuple(value) if typing.get_origin(base) is tuple else value

    return cls(**{name: typed(name, value) for name, value in data.items()})
