"""The docs' facts that a test can hold against the code: the hosts-file sample (its keys and defaults), the
exit codes, the backend rule's table, the make targets, the flags of every `python -m pipeline` and
`python -m ops` command the docs show, with the defaults they state, and the variants and rows the docs' bench
commands name. docs/ops.md's stage table is held by
tests/test_contract.py; docs/quickstart.md's commands run in tests/ops/test_ops_quickstart.py."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tomllib
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
# the pages a reader follows today; docs/benchmarks-history.md is a record of old runs, kept as written
PAGES = [
    REPO / "README.md",
    *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "benchmarks-history.md"),
]


def read(name: str) -> str:
    return (REPO / name).read_text()


def between(text: str, begin: str, end: str) -> str:
    assert begin in text and end in text, (begin, end)
    return text.split(begin, 1)[1].split(end, 1)[0]


# ------------------------------------------------------------------ hosts file (docs/ops.md vs ops/hosts.py)

# keys the sample gives an example value for (a host, a model, an image, a strategy), not the default
EXAMPLE_VALUES = {
    "address",
    "key",
    "known_hosts",
    "model_dir",
    "image",
    "server",
    "server_start",
    "served_model",
}


def hosts_sample() -> dict:
    """The ```toml block of docs/ops.md's "Hosts" section, parsed."""
    section = between(read("docs/ops.md"), "\n## Hosts\n", "\n## ")
    return tomllib.loads(between(section, "```toml\n", "```"))


def test_the_hosts_file_sample_loads_and_names_every_key(tmp_path):
    """docs/ops.md's sample is a hosts file ops accepts, and it shows every key ops knows (so a key added to
    ops/hosts.py without its line in the docs fails here), the train table's too."""
    from ops.hosts import HostConfig, load_hosts_file
    from ops.trainsplit import _KEYS as TRAIN_KEYS

    path = tmp_path / "hosts.toml"
    path.write_text(between(read("docs/ops.md"), "```toml\n", "```"))
    (host,) = load_hosts_file(path).values()
    table = hosts_sample()["hosts"]["gpu-box"]
    known = {f.name for f in dataclasses.fields(HostConfig)} - {"name", "host", "user", "port"}
    assert set(table) - {"address"} == known
    shown = set(table["train"]) | set(re.findall(r"(?m)^# (\w+) =", read("docs/ops.md")))
    assert shown >= set(TRAIN_KEYS)
    assert host.train.states_mode == "hybrid"


def wrong_defaults(table: dict) -> dict:
    """key -> (the sample's value, ops' default) for each key of a sample host table that is neither an
    example value nor the default."""
    from ops.hosts import HostConfig

    default = HostConfig(name="x", host="x")

    def plain(value):
        return list(value) if isinstance(value, (list, tuple)) else value

    return {
        key: (value, getattr(default, key))
        for key, value in table.items()
        if key not in EXAMPLE_VALUES | {"timeouts", "train"} and plain(value) != plain(getattr(default, key))
    }


def test_the_hosts_file_sample_shows_the_defaults():
    """Every value of the sample but the examples (host, model, image, server) is ops' own default, the
    timeouts' ("defaults shown") too; a changed default fails here until the docs say it."""
    from ops.hosts import Timeouts

    table = hosts_sample()["hosts"]["gpu-box"]
    assert wrong_defaults(table) == {}
    assert table["timeouts"] == dataclasses.asdict(Timeouts())


def test_the_defaults_check_sees_a_wrong_default():
    """The check above can fail: a sample value that is not the default is named."""
    table = dict(hosts_sample()["hosts"]["gpu-box"], clean_threshold_mib=2048, secrets=[])
    assert wrong_defaults(table) == {"clean_threshold_mib": (2048, 1024), "secrets": ([], ("HF_TOKEN",))}


# ------------------------------------------------------------------ the backend rule (docs/ops.md)

GIB = 2**30
# the cells of docs/ops.md's backend-rule table -> contract.backends.choose's arguments for that case
RULE_CASES = {
    ("no GPU", "any"): dict(weights_bytes=GIB, gpu_memory_bytes=80 * GIB, gpus=0, has_vllm=True),
    ("GPUs, no vLLM in the image", "any"): dict(
        weights_bytes=500 * GIB, gpu_memory_bytes=80 * GIB, gpus=8, has_vllm=False
    ),
    ("GPUs", "weights over 80% of one GPU's memory, or sizes unknown"): dict(
        weights_bytes=70 * GIB, gpu_memory_bytes=80 * GIB, gpus=2, has_vllm=True
    ),
    ("one GPU", "an MoE whose weights fit one GPU"): dict(
        weights_bytes=20 * GIB, gpu_memory_bytes=80 * GIB, gpus=1, has_vllm=True, experts=(6, 64)
    ),
    ("several GPUs", "an MoE whose weights fit one GPU"): dict(
        weights_bytes=20 * GIB, gpu_memory_bytes=80 * GIB, gpus=4, has_vllm=True, experts=(6, 64)
    ),
    ("GPUs", "a dense model whose weights fit one GPU"): dict(
        weights_bytes=3 * GIB, gpu_memory_bytes=80 * GIB, gpus=1, has_vllm=True
    ),
}


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of a markdown table (header and rule left out), cells stripped."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in markdown.strip().splitlines()]
    return [r for r in rows[2:] if r]


def test_the_backend_rule_table_is_the_rule():
    """Each row of docs/ops.md's backend-rule table is what contract.backends.choose returns for that case
    (and an unknown size also takes vllm); every case of the table is tried."""
    from contract.backends import choose

    rows = table_rows(
        between(read("docs/ops.md"), "<!-- backend-rule:begin -->", "<!-- backend-rule:end -->")
    )
    assert {(r[0], r[1]) for r in rows} == set(RULE_CASES)
    for sees, target, takes in rows:
        assert choose(**RULE_CASES[(sees, target)]).backend == takes, (sees, target)
    assert choose(None, None, 2, True).backend == "vllm"


# ------------------------------------------------------------------ exit codes (ops/errors.py)


def ops_exit_codes() -> dict[int, str]:
    import ops.errors

    return {v: k for k, v in vars(ops.errors).items() if k.startswith("EXIT_") and isinstance(v, int)}


def test_ops_md_lists_every_exit_code():
    """docs/ops.md's exit-code paragraph lists exactly the codes of ops/errors.py's table."""
    text = " ".join(
        between(read("docs/ops.md"), "Exit codes (`ops/errors.py`): ", "Every error is one").split()
    )
    listed = {int(n) for n in re.findall(r"(?:^|; )(\d+) ", text)}
    assert listed == set(ops_exit_codes())


def test_quickstart_lists_every_exit_code():
    """docs/quickstart.md's table of exit codes (what each means, what to do next) has a row for each of
    ops/errors.py's codes, and its pipeline rows are pipeline/errors.py's."""
    from pipeline.errors import CheckFailed, StageError

    rows = table_rows(
        between(read("docs/quickstart.md"), "<!-- exit-codes:begin -->", "<!-- exit-codes:end -->")
    )
    ops_rows = {int(r[0]) for r in rows if r[1] == "ops"}
    assert ops_rows == set(ops_exit_codes())
    pipeline_rows = {int(r[0]) for r in rows if r[1] == "pipeline"}
    assert pipeline_rows == {StageError.exit_code, CheckFailed.exit_code}


# ------------------------------------------------------------------ make targets


def make_targets() -> set[str]:
    """The targets `make help` lists (each `target: ... ## help` line of the Makefile and mk/*.mk)."""
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {line.split("\t")[0] for line in out.splitlines() if line.strip()}


def test_every_make_target_the_docs_name_exists():
    """Each `make TARGET` in README.md and docs/ (the history aside) is a target `make help` lists."""
    targets = make_targets()
    assert {"demo", "test", "gpu-status", "remote-extract"} <= targets
    named = {
        (page.name, target)
        for page in PAGES
        for target in re.findall(r"(?m)(?:`|^\s+)make ([a-z][a-z0-9-]*[a-z0-9])(?![-*\w])", page.read_text())
    }
    missing = sorted((page, t) for page, t in named if t not in targets)
    assert missing == []


# ------------------------------------------------------------------ flags of the commands the docs show

# a backslash-newline first: tried after any other character, it would never be, and a command's continued
# lines would go unchecked
COMMAND = re.compile(r"python3? -m (pipeline|ops) ([a-z][a-z-]*)((?:\\\n|[^`\n|])*)")


def commands() -> dict[str, dict[str, click.Command]]:
    from ops.cli import main as ops_main
    from pipeline.cli import COMMANDS, main as pipeline_main

    ctx = click.Context(pipeline_main)
    return {
        "pipeline": {name: pipeline_main.get_command(ctx, name) for name in COMMANDS},
        "ops": dict(ops_main.commands),
    }


def option_names(command: click.Command) -> set[str]:
    names = {name for p in command.params for name in (*p.opts, *p.secondary_opts) if name.startswith("-")}
    return names | {"--help", "-h"}  # click adds its help option outside params


def documented_invocations() -> list[tuple[str, str, str, list[str]]]:
    """(page, program, command, the words after it up to `--`) for each `python -m pipeline|ops CMD ...`."""
    found = []
    for page in PAGES:
        for program, name, rest in COMMAND.findall(page.read_text()):
            words = re.findall(r"--[a-z][a-z0-9-]*", rest.replace("\\\n", " ").split(" -- ")[0])
            found.append((page.name, program, name, words))
    return found


def test_every_flag_the_docs_show_exists():
    """Each option in a `python -m pipeline STAGE ...` or `python -m ops COMMAND ...` the docs show is an
    option of that command (a renamed or removed flag fails here), and each command exists."""
    known = commands()
    invocations = documented_invocations()
    assert len(invocations) > 20
    wrong = sorted(
        {
            (page, f"{program} {name}", word)
            for page, program, name, words in invocations
            for word in words or ["(command)"]
            if name not in known[program]
            or (word != "(command)" and word not in option_names(known[program][name]))
        }
    )
    assert wrong == []


def flag_defaults() -> dict[str, set[str]]:
    """--flag -> every default it has on the commands of either program (as the command line spells it)."""
    out: dict[str, set[str]] = {}
    for program in commands().values():
        for command in program.values():
            for p in command.params:
                if isinstance(p, click.Option) and not p.is_flag and p.default is not None:
                    default = p.default() if callable(p.default) else p.default
                    for opt in p.opts:
                        out.setdefault(opt, set()).add(str(default))
    return out


DEFAULT_NEAR = re.compile(
    r"`(--[a-z][a-z0-9-]*)[ =]([a-z0-9][^`\s]*)`[^.;|`]{0,20}\bdefault|"
    r"\bdefault[^.;|`]{0,12}`(--[a-z][a-z0-9-]*)[ =]([a-z0-9][^`\s]*)`"
)


def test_the_defaults_the_docs_state_are_the_commands():
    """Where a doc says a flag's value is the default (`--backend auto` (the default), "default
    `--states-mode offline`"), that is the flag's default on our commands."""
    defaults = flag_defaults()
    stated = [
        (page.name, m[0] or m[2], m[1] or m[3])
        for page in PAGES
        for m in DEFAULT_NEAR.findall(page.read_text())
        if (m[0] or m[2]) in defaults
    ]
    assert len(stated) >= 3
    wrong = [
        (page, flag, value, sorted(defaults[flag]))
        for page, flag, value in stated
        if value not in defaults[flag]
    ]
    assert wrong == []


def test_the_flag_checks_see_a_wrong_flag():
    """The checks above can fail: a misspelt option and a wrong default are found."""
    known = commands()
    assert "--layer-id" not in option_names(known["pipeline"]["extract"])
    assert "--layer-ids" in option_names(known["pipeline"]["extract"])
    line = "with `--closing-check full` (the default)"
    assert DEFAULT_NEAR.findall(line)[0][:2] == ("--closing-check", "full")
    assert "full" not in flag_defaults()["--closing-check"]


# ------------------------------------------------------------------ benchmark commands (variants, rows)

BENCH_CHOICES = re.compile(r"-m bench\.(hf_levers|capture_bench)\b((?:\\\n|[^`\n|])*)")


def bench_choices(text: str) -> list[tuple[str, str]]:
    """(bench, name) for each variant (``--variants``, an ``@experts`` suffix left off) or row (``--rows``)
    that a ``python -m bench.hf_levers|capture_bench`` command in ``text`` names."""
    found = []
    for bench, rest in BENCH_CHOICES.findall(text):
        flag = "--variants" if bench == "hf_levers" else "--rows"
        for m in re.finditer(rf"{flag}[ =]([a-z0-9@_,-]+)", rest.replace("\\\n", " ")):
            found += [(bench, name.split("@")[0]) for name in m[1].split(",")]
    return found


def test_every_variant_and_row_the_docs_name_exists():
    """The benches' ``--variants`` and ``--rows`` in the docs' commands (the queued GPU runs among them) are
    the benches' own: a command that names one they do not have costs a GPU call to find out (2026-12-07)."""
    from bench.capture_bench import ROWS
    from bench.hf_levers import FILES, VARIANTS

    known = {"hf_levers": {*VARIANTS, *FILES}, "capture_bench": set(ROWS)}
    named = [(page.name, *choice) for page in PAGES for choice in bench_choices(page.read_text())]
    assert len(named) > 20
    assert [n for n in named if n[2] not in known[n[1]]] == []
    # the check sees a wrong name on a continued line (the command that cost a call, as it was queued)
    queued = "python3 -m bench.hf_levers --shapes dsv3-9b \\\n    --variants plain-32k,plain-fused-64k@eager`"
    assert [n for n in bench_choices(queued) if n[1] not in known[n[0]]] == [("hf_levers", "plain-fused-64k")]


# ------------------------------------------------------------------ docs/quickstart.md


def test_the_quickstart_hosts_files_load(tmp_path):
    """Each hosts file docs/quickstart.md offers (one per server strategy) is one ops accepts, and together
    they show every strategy ops/server.py knows."""
    from ops.hosts import load_hosts_file

    blocks = re.findall(r"```toml\n(.*?)```", read("docs/quickstart.md"), re.S)
    kinds = set()
    for i, block in enumerate(blocks):
        path = tmp_path / f"hosts-{i}.toml"
        path.write_text(block)
        (host,) = load_hosts_file(path).values()
        kinds.add(host.server.kind)
    assert kinds == {"container", "compose", "systemd", "pidfile", "none"}


def test_readme_links_the_quickstart():
    assert "docs/quickstart.md" in read("README.md")
