"""Generated inputs for what ops reads from a file an operator or a host hands it: the hosts file, a run's
state.json (attach reopens it), a host's summary.json (fetched, then merged across hosts, and read back by a
re-run): each reader gives a right result or one line (an OpsError, whose exit code the CLI uses), never
another exception, and writes nothing but its own output. Cases: the hypothesis profile's max_examples
(tests/conftest.py: 200 by default, 5000 under `make fuzz`). Failures found are kept below as plain tests."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ops.errors import OpsError
from ops_helpers import toml_value


def one_line(exc: OpsError) -> str:
    text = str(exc)
    assert text and "\n" not in text, repr(text)
    return text


def snapshot(root: Path) -> dict[str, tuple[int, int] | None]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[str((Path(dirpath) / name).relative_to(root))] = None
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = (p.lstat().st_size, p.lstat().st_mtime_ns)
    return out


SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALAR,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=10,
)
TOML_SCALAR = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(
        ["/abs/path", "table:/x.json", "pidfile:/run/x.pid", "container:vllm", "nvml", "root", "16g"]
    )
)
TOML_VALUE = TOML_SCALAR | st.lists(TOML_SCALAR, max_size=3)

VALID_HOST = {
    "host": "127.0.0.1",
    "port": 22,
    "user": "ops",
    "python": "/usr/bin/python3",
    "server": "pidfile:/run/server.pid",
    "device_glob": "/dev/nvidia*",
    "gpu_source": "table:/tmp/gpus.json",
    "lock_file": "/run/lock/eagle-ops.lock",
    "clean_threshold_mib": 1024,
    "protected": ["nvidia-persistenced"],
}
VALID_TIMEOUTS = {"grace": 10, "kill_wait": 5, "stop": 60, "clean": 30}
KEYS = sorted(VALID_HOST) + [
    "address",
    "timeouts",
    "data_root",
    "backend",
    "tensor_parallel_size",
    "mounts",
    "x",
]


def _toml(name: str, table: dict, timeouts: dict | None) -> str:
    lines = [f"[hosts.{json.dumps(name)}]"]
    lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    if timeouts is not None:
        lines.append(f"[hosts.{json.dumps(name)}.timeouts]")
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in timeouts.items()]
    return "\n".join(lines) + "\n"


def _edited(base: dict, keys: list[str], values) -> st.SearchStrategy:
    drop = object()

    def apply(edits: dict) -> dict:
        out = dict(base)
        for k, v in edits.items():
            if v is drop:
                out.pop(k, None)
            else:
                out[k] = v
        return out

    return st.dictionaries(st.sampled_from(keys), values | st.just(drop), max_size=3).map(apply)


HOSTS_TEXT = st.one_of(
    st.builds(
        _toml,
        st.sampled_from(["box", "gpu-1", "a b", "..", "-x", "é"]) | st.text(max_size=6),
        _edited(VALID_HOST, KEYS, TOML_VALUE),
        st.none() | _edited(VALID_TIMEOUTS, sorted(VALID_TIMEOUTS) + ["lock_expire", "y"], TOML_VALUE),
    ).map(str.encode),
    st.binary(max_size=60),
    st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@given(content=HOSTS_TEXT)
def test_hosts_file(content):
    """Any hosts file: hosts with a port 1-65535, finite positive timeouts and absolute paths where the
    file gives paths, or one line naming the file (exit 2); nothing written."""
    from ops.hosts import load_hosts_file

    root = Path(tempfile.mkdtemp(prefix="prop-hosts-"))
    try:
        path = root / "hosts.toml"
        path.write_bytes(content)
        before = snapshot(root)
        try:
            hosts = load_hosts_file(path)
        except OpsError as exc:
            assert str(path) in one_line(exc) and exc.exit_code == 2, exc
        else:
            for host in hosts.values():
                assert host.port is None or (isinstance(host.port, int) and 0 < host.port < 65536)
                for field in ("grace", "kill_wait", "stop", "clean"):
                    value = getattr(host.timeouts, field)
                    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (
                        field,
                        value,
                    )
                assert host.lock_file.startswith("/")
        assert snapshot(root) == before
    finally:
        shutil.rmtree(root, ignore_errors=True)


STATE = st.one_of(
    JSON.map(lambda v: json.dumps(v).encode()),
    _edited(
        {"run_id": "r1", "host": "box", "stage": "extract", "status": "done", "step": "fetch", "steps": []},
        ["run_id", "host", "stage", "status", "step", "steps", "error", "container"],
        JSON,
    ).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
)


@given(content=STATE)
def test_run_state_reopened_by_attach(content):
    """Any state.json of an earlier run: attach reopens it as a running state of this run (its id, host
    and stage), records its next steps and saves one JSON object; only state.json is (re)written."""
    from ops.runstate import RunState

    root = Path(tempfile.mkdtemp(prefix="prop-state-"))
    try:
        path = root / "state.json"
        path.write_bytes(content)
        state = RunState.reopen(path, None, run_id="r1", host="box", stage="extract")
        state.step("attach")
        state.step("follow")
        saved = json.loads(path.read_text())
        assert isinstance(saved, dict) and saved["status"] == "running"
        assert (saved["run_id"], saved["host"], saved["stage"]) == ("r1", "box", "extract")
        assert [s["step"] for s in saved["steps"][-2:]] == ["attach", "follow"]
        assert sorted(p.name for p in root.iterdir()) == ["state.json"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


SUMMARY = st.one_of(
    JSON,
    _edited(
        {
            "ok": True,
            "stats": {"samples": 4, "files": 2, "rank": 0, "world_size": 2, "missing": [], "tokens": 9},
        },
        ["ok", "stats", "provenance", "schema", "checks"],
        JSON,
    ),
    st.fixed_dictionaries(
        {
            "ok": st.booleans(),
            "stats": _edited(
                {"samples": 4, "files": 2, "rank": 0, "world_size": 2},
                ["samples", "files", "rank", "world_size", "missing", "tokens"],
                JSON,
            ),
        }
    ),
)


@given(summary=SUMMARY, raw=st.binary(max_size=30), use_raw=st.booleans())
def test_summary_json_of_a_host(summary, raw, use_raw):
    """A host's summary.json of any content: its merged section says complete only for a summary of the
    whole shard, and a re-run reads the merged record back or refuses it in one line (exit 2)."""
    from ops.fanout import OK, HostResult, find_previous, host_section
    from ops.remote_run import summary_of

    root = Path(tempfile.mkdtemp(prefix="prop-summary-"))
    try:
        local = root / "fetched"
        local.mkdir()
        (local / "summary.json").write_bytes(raw if use_raw else json.dumps(summary).encode())
        fetched = summary_of(local / "summary.json")
        assert fetched is None or isinstance(fetched, dict)
        section = host_section(HostResult("box", 0, OK, 0, summary=fetched), world_size=2)
        assert isinstance(section["complete"], bool)
        if section["complete"]:
            assert fetched["ok"] is True and fetched["stats"]["files"] == 2
        run = root / "runs" / "r1"
        run.mkdir(parents=True)
        (run / "summary.json").write_bytes(raw if use_raw else json.dumps(summary).encode())
        before = snapshot(root)
        try:
            previous = find_previous(root / "runs", "r1", "extract", ["a", "b"])
        except OpsError as exc:
            assert exc.exit_code == 2 and "summary.json" in one_line(exc)
        else:
            assert previous is None or isinstance(previous, dict)
        assert snapshot(root) == before
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------- failures the generator found, kept as plain tests


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe[hosts.x]\n",
        b'[hosts.box]\nhost = "\xc3"\n',
        b'[hosts.box]\naddress = ":"\n',
        b'[hosts.box]\nhost = "h"\nserver = "0"\n',
    ],
)
def test_found_hosts_files(tmp_path, content):
    """A hosts file that is not UTF-8 (was: UnicodeDecodeError traceback), an address or a server strategy
    of the wrong form (found under `make fuzz`: the line named neither the file nor the host): one line
    naming the file, exit 2."""
    from ops.hosts import load_hosts_file

    path = tmp_path / "hosts.toml"
    path.write_bytes(content)
    with pytest.raises(OpsError) as info:
        load_hosts_file(path)
    assert str(path) in one_line(info.value) and info.value.exit_code == 2


@pytest.mark.parametrize("content", ["[1, 2]", '{"steps": "x"}', '{"steps": [1], "run_id": "other"}', "null"])
def test_found_state_json_that_is_not_a_run_state(tmp_path, content):
    """state.json holding a JSON array (was: TypeError out of attach), `steps` that is not a list (was:
    AttributeError at the next step), another run's id: attach records this run's steps."""
    from ops.runstate import RunState

    path = tmp_path / "state.json"
    path.write_text(content)
    state = RunState.reopen(path, None, run_id="r1", host="box", stage="extract")
    state.step("attach")
    saved = json.loads(path.read_text())
    assert saved["run_id"] == "r1" and saved["steps"][-1]["step"] == "attach"


@pytest.mark.parametrize("content", [b"[1, 2]", b'"ok"', b'{"ok": true, "stats": [1]}', b"\xff"])
def test_found_summaries_that_are_not_objects(tmp_path, content):
    """A host's summary.json that is a JSON array or string, or whose stats is a list (was: AttributeError
    in the merge), or not UTF-8: no summary, or an incomplete shard; never an exception."""
    from ops.fanout import OK, HostResult, host_section
    from ops.remote_run import summary_of

    (tmp_path / "summary.json").write_bytes(content)
    fetched = summary_of(tmp_path / "summary.json")
    section = host_section(HostResult("box", 0, OK, 0, summary=fetched), world_size=1)
    assert section["complete"] is False


# ---------------------------------------------------------------- numeric and path options

WAIT_TEXT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["nan", "inf", "-0", "1e309", "604800", "604801", "0.001", "", "x", "1_0"]),
)
PATH_TEXT = st.lists(
    st.sampled_from(["loop-a", "hosts.toml", "dir", "..", ".", "missing", "x" * 300, "a b", "binary.toml"]),
    min_size=1,
    max_size=3,
).map("/".join)
LABEL_TEXT = st.text(max_size=12) | st.sampled_from(["r1", "..", ".", "a/b", "-x", "x" * 200, "é"])


@given(wait=WAIT_TEXT, hosts_file=PATH_TEXT, runs_dir=PATH_TEXT, run_id=LABEL_TEXT)
def test_numeric_and_path_options(wait, hosts_file, runs_dir, run_id):
    """ops' own numeric and path options, read as its commands read them: `--wait` (click and its check),
    `--hosts-file` (resolve_host), `--runs-dir` and a run id (run_dir): a value in range, or one line with
    exit 2; nothing written."""
    import click

    from ops.cli import main
    from ops.hosts import MAX_TIMEOUT_S, resolve_host
    from ops.runstate import run_dir

    root = Path(tempfile.mkdtemp(prefix="prop-opts-"))
    try:
        (root / "loop-a").symlink_to(root / "loop-b")
        (root / "loop-b").symlink_to(root / "loop-a")
        (root / "dir").mkdir()
        (root / "hosts.toml").write_text('[hosts.box]\nhost = "127.0.0.1"\n')
        (root / "binary.toml").write_bytes(b"\xff\x00[")
        before = snapshot(root)
        cmd = main.get_command(click.Context(main), "stop-server")
        try:
            with cmd.make_context(
                "stop-server", ["--host", "box", "--wait", wait], resilient_parsing=False
            ) as ctx:
                value = ctx.params["lock_wait"]
            assert value == 0 or (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S), (wait, value)
        except click.UsageError as exc:
            assert exc.exit_code == 2 and "\n" not in exc.format_message()
        except OpsError as exc:
            assert exc.exit_code == 2 and "--wait" in one_line(exc)
        try:
            host = resolve_host("box", str(root / hosts_file))
            assert host.name == "box" or host.host == "box"
        except OpsError as exc:
            assert exc.exit_code == 2, exc
            one_line(exc)
        try:
            path = run_dir(root / runs_dir, "box", run_id)
            assert (root / runs_dir).resolve() in path.resolve().parents
        except OpsError as exc:
            assert exc.exit_code == 2, exc
            one_line(exc)
        assert snapshot(root) == before
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", ["x" * 300, "loop-a", "loop-a/hosts.toml", "file/hosts.toml"])
def test_found_hosts_file_paths_the_kernel_cannot_walk(tmp_path, name):
    """--hosts-file with a name over 255 bytes (was: an OSError traceback from pathlib), on a symlink loop
    or under a file (were "does not exist"; now the kernel's reason): one line naming it, exit 2."""
    from ops.hosts import resolve_host

    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    (tmp_path / "file").write_text("")
    with pytest.raises(OpsError) as info:
        resolve_host("box", str(tmp_path / name))
    assert "hosts file" in one_line(info.value) and info.value.exit_code == 2


def test_found_runs_dir_on_a_symlink_loop(tmp_path):
    """--runs-dir on a symlink loop (was: RuntimeError: Symlink loop): one line naming it, exit 2."""
    from ops.runstate import run_dir

    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    with pytest.raises(OpsError) as info:
        run_dir(tmp_path / "loop-a", "box", "r1")
    assert "--runs-dir" in one_line(info.value) and info.value.exit_code == 2


PIDS = st.lists(st.integers(min_value=2, max_value=60), max_size=6, unique=True)


@given(members=PIDS, ours=PIDS, pgid=st.none() | st.integers(min_value=2, max_value=60), start=st.booleans())
def test_a_pidfile_group_holding_ops_own_processes(members, ours, pgid, start):
    """Issue #50 item 1: the probe's pid-file facts of any shape (members, the ones that are ops' own, the
    group): the stop and restore plans either go ahead without a pid of ops' own among the server's, or
    refuse in one line that the pid file points at the operator's own processes (exit 7 stop, 8 restore);
    a holder of that group is never classified as the server's."""
    from ops.gpus import SERVER, Proc, ServerFacts, classify
    from ops.hosts import HostConfig, Timeouts, parse_strategy
    from ops.server import plan_restore, plan_stop

    ours = [p for p in ours if p in members]
    host = HostConfig(
        name="h", host="h", server=parse_strategy("pidfile:/run/v.pid"), timeouts=Timeouts(stop=3),
        server_start=("/bin/true",) if start else (),
    )  # fmt: skip
    facts = ServerFacts("pidfile", pgid=pgid, members=tuple(members), ours=tuple(ours))
    for plan, code in ((plan_stop, 7), (plan_restore, 8)):
        try:
            plan(host, facts)
        except OpsError as exc:
            text = one_line(exc)
            assert exc.exit_code == code or (code == 8 and not start), text
            assert bool(ours) == ("points at the operator's own processes" in text), text
        else:
            assert not ours
    for pid in members:
        proc = Proc(pid, "x", "x", "u", "S", 1, pgid or pid, 0, None, None)
        assert not (ours and classify(proc, host, facts, set())[0] == SERVER)
