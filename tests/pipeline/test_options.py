"""pipeline/options.py: a config dataclass makes its click options (defaults, help, flags, choices, ranges,
hidden and code-only fields) and refuses a bad value at construction with the command line's own words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import click
import click.testing
import pytest

from pipeline.errors import StageError
from pipeline.options import config_of, opt, options, validate
from tests.conftest import run_pipeline


@dataclass(frozen=True)
class Toy:
    """A config that uses every kind of field."""

    src: Path = opt(argument=True)
    out: Path = opt(help="Where to write.")
    size: int = opt(8, help="How many.", low=1, high=64)
    rate: float | None = opt(None, low=0, low_open=True, click_range=True, help="A rate.")
    workers: int = opt(0, low=0, click_range=True)
    mode: str = opt("fast", choices=("fast", "slow"))
    force: bool = opt(False, help="Do it anyway.")
    checks: bool = opt(True, decls="--no-checks", help="Skip the checks.")
    pair: bool = opt(False, decls="--pair/--no-pair")
    secret: int | None = opt(None, hidden=True)
    internal: int = opt(5, cli=False)

    def __post_init__(self) -> None:
        validate(self)


@click.command("toy")
@options(Toy)
def toy(**kwargs) -> None:
    click.echo(repr(Toy(**kwargs)))


def parse(*words: str) -> dict:
    with toy.make_context("toy", list(words)) as ctx:
        return ctx.params


def cli_error(*words: str) -> str:
    """The one-line message click gives for the words (no usage lines)."""
    with pytest.raises(click.UsageError) as caught:
        parse(*words)
    return caught.value.format_message()


def test_defaults_flags_and_types_come_from_the_fields():
    """Unset options take the field defaults; flags set bools; values arrive typed, names are the fields'."""
    got = parse("s", "--out", "o")
    assert Toy(**got) == Toy(src=Path("s"), out=Path("o"))
    got = parse(
        "s",
        "--out",
        "o",
        "--size",
        "3",
        "--rate",
        "0.5",
        "--mode",
        "slow",
        "--force",
        "--no-checks",
        "--pair",
        "--secret",
        "7",
    )
    assert got == {
        "src": Path("s"),
        "out": Path("o"),
        "size": 3,
        "rate": 0.5,
        "workers": 0,
        "mode": "slow",
        "force": True,
        "checks": False,
        "pair": True,
        "secret": 7,
    }
    assert "internal" not in got and Toy(**got).internal == 5


def test_required_hidden_and_code_only_fields():
    """A field without default is required; a hidden one is accepted, not shown; a code-only one is not
    an option."""
    assert "Missing option '--out'" in cli_error("s")
    assert "No such option '--internal'" in cli_error("s", "--out", "o", "--internal", "1")
    help_text = toy.get_help(click.Context(toy))
    assert "--secret" not in help_text and "--internal" not in help_text


def test_help_shows_each_fields_help_and_default():
    """--help carries the field's help text, its default where it has one, a flag pair, click's range."""
    help_text = " ".join(toy.get_help(click.Context(toy)).split())
    for text in (
        "--out PATH Where to write. [required]",
        "--size INTEGER How many. [default: 8]",
        "--rate FLOAT RANGE A rate. [x>0]",
        "--workers INTEGER RANGE [default: 0; x>=0]",
        "--mode [fast|slow] [default: fast]",
        "--force Do it anyway.",
        "--no-checks Skip the checks.",
        "--pair / --no-pair [default: no-pair]",
    ):
        assert text in help_text, text
    assert "--rate FLOAT RANGE A rate. [default" not in help_text  # a None default is not shown


@pytest.mark.parametrize(
    ("words", "field"),
    [
        (("--mode", "medium"), {"mode": "medium"}),
        (("--workers", "-1"), {"workers": -1}),
        (("--rate", "0"), {"rate": 0.0}),
    ],
)
def test_construction_refuses_what_click_refuses_in_its_words(words, field):
    """A bad choice or click-checked range fails at construction with the message the command line gives."""
    message = cli_error("s", "--out", "o", *words)
    with pytest.raises(StageError) as caught:
        Toy(src=Path("s"), out=Path("o"), **field)
    assert str(caught.value) == message


def test_construction_checks_ranges_click_does_not():
    """A range only the config checks is refused in require_range's words, through the command too."""
    with pytest.raises(StageError, match=r"^--size 0 is outside the allowed range \(1\.\.64\)$"):
        Toy(src=Path("s"), out=Path("o"), size=0)
    with pytest.raises(StageError, match="--size 65"):
        dataclasses.replace(Toy(src=Path("s"), out=Path("o")), size=65)
    result = click.testing.CliRunner().invoke(toy, ["s", "--out", "o", "--size", "0"])
    assert isinstance(result.exception, StageError)
    assert Toy(src=Path("s"), out=Path("o"), size=64, rate=None).size == 64  # the ends are allowed, None too


def test_stage_commands_are_made_from_their_configs():
    """prepare, weights, verify, train and extract: one option per command-line field, named by it, each with
    its help text, and the command knows its config (check-args builds it)."""
    from pipeline.cli import COMMANDS, main
    from pipeline.options import spec_of

    for stage in ("prepare", "weights", "verify", "train", "extract"):
        cmd = main.get_command(click.Context(main), stage)
        cls = config_of(cmd)
        assert cls is not None and stage in COMMANDS
        wanted = [f.name for f in dataclasses.fields(cls) if spec_of(f).cli]
        wanted += ["json_stats"] if stage == "extract" else []  # the benchmarks' JSON figures, not a setting
        assert [p.name for p in cmd.params if p.name != "help"] == wanted, stage
        assert [p.name for p in cmd.params if isinstance(p, click.Option) and not p.help] == [], stage


def test_stage_configs_refuse_bad_values_in_the_cli_words():
    """The stages' checks run at construction: prepare's range, train's choices and counts, verify's rank."""
    from pipeline.prepare import PrepareConfig
    from pipeline.train.stage import DTYPES, TrainConfig
    from pipeline.verify import VerifyConfig

    with pytest.raises(StageError, match=r"^--seq-length 1 is outside the allowed range"):
        PrepareConfig(data=Path("d"), model=Path("m"), out=Path("o"), seq_length=1)
    base = {"data": Path("d"), "verifier": Path("v"), "out": Path("o")}
    with pytest.raises(StageError, match=r"^Invalid value for '--scheduler': 'x' is not one of"):
        TrainConfig(**base, scheduler="x")
    with pytest.raises(StageError, match=r"^--epochs 0 is outside the allowed range \(at least 1\)$"):
        TrainConfig(**base, epochs=0)
    save_dtype = next(f for f in dataclasses.fields(TrainConfig) if f.name == "save_dtype")
    assert set(save_dtype.metadata["pipeline.options"].choices) == set(DTYPES)
    with pytest.raises(StageError, match=r"^--rank 2 is outside the allowed range \(0\.\.1\)$"):
        VerifyConfig(path=Path("p"), world_size=2, rank=2)


def test_check_args_builds_the_config():
    """`pipeline check-args` refuses a value the config refuses, before any stage runs."""
    words = ("check-args", "prepare", "--data", "d", "--model", "m", "--out", "o", "--seq-length")
    proc = run_pipeline(*words, "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.strip() == (
        "FAIL arguments: pipeline prepare: --seq-length 1 is outside the allowed range (2..1048576)"
    )
    proc = run_pipeline(*words, "2")
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


def test_the_option_module_imports_no_ml_stack():
    """pipeline/options.py loads click and the standard library only: no torch, numpy or transformers."""
    import subprocess
    import sys

    code = (
        "import sys, pipeline.options; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'transformers'}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_extract_refuses_at_construction_what_check_args_can_see():
    """extract's ranges and its options that contradict each other are refused when its config is built (so
    `pipeline check-args` refuses them before the host is touched); layer ids parse from comma-separated
    words."""
    from pipeline.extract.cli import command
    from pipeline.extract.config import ExtractConfig

    base = dict(prepared=Path("p"), model=Path("m"), out=Path("o"))
    for bad, message in [
        (dict(limit=0), r"^--limit 0 is outside the allowed range"),
        (dict(world_size=2, rank=2), r"^--rank 2 must be in 0\.\.1"),
        (dict(closing_check="fast"), r"^unknown --closing-check 'fast'"),
        (dict(writer_threads=0), r"^--writer-threads 0 must be at least 1"),
        (dict(tensor_parallel_size=0), r"^--tensor-parallel-size 0 is outside"),
        (dict(data_parallel=2, device="cuda:1"), r"^--data-parallel gives each worker one GPU"),
    ]:
        with pytest.raises(StageError, match=message):
            ExtractConfig(**base, **bad)
    ctx = command.make_context(
        "extract", ["--prepared", "p", "--model", "m", "--out", "o", "--layer-ids", "2, 4,5,7"]
    )
    assert ctx.params["layer_ids"] == (2, 4, 5, 7)
    with pytest.raises(StageError, match=r"^bad --layer-ids '2,x': expected comma-separated integers"):
        command.make_context(
            "extract", ["--prepared", "p", "--model", "m", "--out", "o", "--layer-ids", "2,x"]
        )


def test_a_config_crosses_to_a_child_as_json_fields():
    """to_json/from_json rebuild the same config (paths and tuples typed again); a field of another version,
    a missing required one or text that is not JSON is a one-line StageError."""
    from pipeline.extract.config import ExtractConfig
    from pipeline.options import from_json, to_json

    cfg = ExtractConfig(prepared=Path("p"), model=Path("m"), out=Path("o"), layer_ids=(2, 5), local_rank=1)
    again = from_json(ExtractConfig, to_json(cfg))
    assert again == cfg and isinstance(again.out, Path) and again.layer_ids == (2, 5)
    for text, words in (
        ('{"prepared": "p", "model": "m", "out": "o", "speed": 1}', "no field speed"),
        ('{"prepared": "p", "out": "o"}', "missing model"),
        ("not json", "as JSON expected"),
        ('{"prepared": "p", "model": "m", "out": "o", "limit": 0}', "--limit"),
    ):
        with pytest.raises(StageError, match=words):
            from_json(ExtractConfig, text)
