"""Generated inputs for every reader of a file a user or a host hands the pipeline (conversations JSONL,
config.json and its index, tokenizer files, safetensors headers, the prepared set, data_{i}.pt,
data_config.json, checksums) and for every numeric and path option: each reader returns a right result or
refuses in one line (a StageError; in verify a failed check), never another exception, and changes nothing
on disk. The generator starts from the real file (a tiny model's, a real prepared and extracted set) and
damages it: cut, replaced by bytes, a field set to any JSON value or removed.

Cases per reader: the hypothesis profile's ``max_examples`` (tests/conftest.py: 200 by default,
``HYPOTHESIS_PROFILE=fuzz``, `make fuzz`, for more). A failure found here is kept as a plain test below
(`test_found_*`)."""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import StageError

# ---------------------------------------------------------------- what every case must hold


def refusal(exc: BaseException) -> str:
    """A refusal's text, checked: one non-empty line."""
    text = str(exc)
    assert text and "\n" not in text and "Traceback" not in text, repr(text)
    return text


def snapshot(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under ``root``: a file's size and mtime, None for a directory (its mtime moves with a
    summary.json written beside the files, which verify owns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[str((Path(dirpath) / name).relative_to(root))] = None
        for name in filenames:
            p = Path(dirpath) / name
            st_ = p.lstat()
            out[str(p.relative_to(root))] = (st_.st_size, st_.st_mtime_ns)
    return out


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """``python -m pipeline ARGS`` in this process (the CLI's own entry point): exit code, stdout, stderr."""
    from pipeline.cli import run

    monkeypatch.setattr(sys, "argv", ["pipeline", *map(str, args)])
    capsys.readouterr()
    try:
        run()
        rc = 0
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out.strip(), err.strip()


class Case:
    """A private directory for one generated case, its tree compared before and after the reader ran."""

    def __init__(self, *sources: tuple[Path, str]):
        self.root = Path(tempfile.mkdtemp(prefix="prop-"))
        for src, name in sources:
            dst = self.root / name
            if src.is_dir():
                shutil.copytree(src, dst, symlinks=True)
            else:
                shutil.copy2(src, dst)

    def __enter__(self) -> Path:
        return self.root

    def check_unchanged(self, before: dict) -> None:
        assert snapshot(self.root) == before, "the reader changed what it read"

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------- generated documents

DELETE = object()
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
LONE_SURROGATE = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
TEXT = (
    st.text(max_size=30) | LONE_SURROGATE | st.builds(lambda a, b: a + b, st.text(max_size=5), LONE_SURROGATE)
)


def edited(base: dict, values=JSON) -> st.SearchStrategy:
    """``base`` with up to 3 of its keys (or new ones) set to any JSON value or removed."""
    keys = st.sampled_from(sorted(base)) | st.text(max_size=6) if base else st.text(max_size=6)

    def apply(edits: dict) -> dict:
        out = dict(base)
        for k, v in edits.items():
            if v is DELETE:
                out.pop(k, None)
            else:
                out[k] = v
        return out

    return st.dictionaries(keys, values | st.just(DELETE), min_size=1, max_size=3).map(apply)


def document(valid: bytes, obj: dict | None = None) -> st.SearchStrategy:
    """The bytes of a damaged copy of a file whose intact bytes are ``valid`` (a JSON object ``obj``)."""
    options = [
        st.binary(max_size=64),
        st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, max(0, len(valid) - 1)), st.binary(min_size=1, max_size=4)).map(
            lambda t: valid[: t[0]] + t[1] + valid[t[0] + len(t[1]) :]
        ),
        JSON.map(lambda v: json.dumps(v).encode()),
    ]
    if obj is not None:
        options.append(edited(obj).map(lambda d: json.dumps(d).encode()))
        options.append(edited(obj).map(lambda d: json.dumps(d).encode()))  # twice as likely as the others
    return st.one_of(*options)


# ---------------------------------------------------------------- conversations JSONL

ROLES = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", "Assistant", "bogus"])
TURN = st.fixed_dictionaries(
    {"role": ROLES | JSON, "content": TEXT | JSON},
    optional={
        "reasoning_content": TEXT | JSON,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"function": st.fixed_dictionaries({"name": TEXT, "arguments": JSON | TEXT})}
            )
        )
        | JSON,
        "name": TEXT,
    },
)
SHAREGPT = st.fixed_dictionaries({"from": ROLES | JSON, "value": TEXT | JSON})
ROW = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(TURN, max_size=4) | JSON}),
    st.fixed_dictionaries({"conversations": st.lists(SHAREGPT, max_size=4) | JSON}),
    JSON,
)
LINE = st.one_of(
    ROW.map(lambda r: json.dumps(r).encode()),
    ROW.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", errors="surrogatepass")),
    st.binary(max_size=40),
)


@pytest.fixture(scope="module")
def masker(tiny_llama):
    from pipeline.prepare import TemplateMasker, load_tokenizer

    return TemplateMasker(load_tokenizer(tiny_llama, False))


@given(lines=st.lists(LINE, min_size=1, max_size=4), skip=st.booleans())
def test_conversation_rows(masker, tiny_llama, lines, skip):
    """Each row is messages the template renders to ids and a mask of one length, a row the masker
    refuses by a ValueError (prepare's one line for that row), or the reader's one line; --skip-invalid
    turns every refused row into a skipped one."""
    from pipeline.prepare import read_rows

    case = Case()
    with case as case_dir:
        path = case_dir / "rows.jsonl"
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
        before = snapshot(case_dir)
        try:
            rows = list(read_rows(path, skip_invalid=skip))
        except StageError as exc:
            assert not skip
            assert refusal(exc).startswith(f"{path}:")
            rows = []
        for _, messages in rows:
            if messages is None:
                assert skip
                continue
            assert any(m["role"] == "assistant" for m in messages)
            for m in messages:
                assert isinstance(m["content"], str)
                m["content"].encode("utf-8")  # text every encoder takes
            try:
                ids, mask = masker(messages)
            except ValueError as exc:
                refusal(exc)
                continue
            assert len(ids) == len(mask) and all(isinstance(i, int) and i >= 0 for i in ids)
        case.check_unchanged(before)


# ---------------------------------------------------------------- model dir: config.json, index, tokenizer


@functools.cache
def _model_file(tiny_llama: Path, name: str) -> bytes:
    return (tiny_llama / name).read_bytes()


def _model_case(tiny_llama: Path, name: str, content: bytes) -> Case:
    case = Case()
    model = case.root / "model"
    model.mkdir()
    for p in tiny_llama.iterdir():
        if p.name != name:
            (model / p.name).symlink_to(p)
    (model / name).write_bytes(content)
    return case


@given(data=st.data())
def test_config_json(tiny_llama, data):
    """config.json, any damage: the model dir's facts are positive integers and a list of names, or one
    line naming config.json."""
    from pipeline.model.modeldir import read_model_dir

    valid = _model_file(tiny_llama, "config.json")
    content = data.draw(document(valid, json.loads(valid)))
    case = _model_case(tiny_llama, "config.json", content)
    with case as root:
        before = snapshot(root)
        try:
            info = read_model_dir(root / "model")
        except StageError as exc:
            assert "config.json" in refusal(exc)
        else:
            for n in (info.num_layers, info.hidden_size, info.vocab_size):
                assert isinstance(n, int) and n > 0
            assert isinstance(info.architecture, str)
        case.check_unchanged(before)


@given(data=st.data())
def test_safetensors_index(tiny_llama, data):
    """model.safetensors.index.json, any damage, beside the real shard: a map of tensor names to shard
    files inside the model dir, or one line naming the index."""
    from pipeline.ondisk.readers import INDEX, read_weight_map

    names = _tensor_names(tiny_llama)
    valid = {"metadata": {"total_size": 1}, "weight_map": {n: "model.safetensors" for n in names}}
    content = data.draw(
        document(json.dumps(valid).encode(), valid)
        | edited(
            valid["weight_map"],
            values=JSON | st.sampled_from(["model.safetensors", "../x", "/etc/passwd", ""]),
        ).map(lambda wm: json.dumps({"weight_map": wm}).encode())
    )
    case = _model_case(tiny_llama, INDEX, content)
    with case as root:
        before = snapshot(root)
        try:
            wmap = read_weight_map(root / "model")
        except StageError as exc:
            refusal(exc)
        else:
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items())
            model = root / "model"
            assert all(Path(os.path.normpath(model / v)).parent == model for v in wmap.values()), wmap
        case.check_unchanged(before)


def _tensor_names(tiny_llama: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(tiny_llama / "model.safetensors"), framework="pt") as fh:
        return list(fh.keys())


@given(data=st.data(), which=st.sampled_from(["tokenizer_config.json", "tokenizer.json"]))
def test_tokenizer_files(tiny_llama, data, which):
    """tokenizer_config.json or tokenizer.json, any damage: a tokenizer that encodes text, or one line
    naming the model dir."""
    from pipeline.ondisk.readers import load_tokenizer

    valid = _model_file(tiny_llama, which)
    content = data.draw(document(valid, json.loads(valid)))
    case = _model_case(tiny_llama, which, content)
    with case as root:
        before = snapshot(root)
        try:
            tok = load_tokenizer(root / "model", False)
        except StageError as exc:
            assert str(root / "model") in refusal(exc)
        else:
            ids = tok("hello world")["input_ids"]
            assert all(isinstance(i, int) for i in ids)
        case.check_unchanged(before)


# ---------------------------------------------------------------- safetensors headers


@pytest.fixture(scope="module")
def verifier_file(tmp_path_factory, tiny_llama):
    from pipeline.weights import run

    out = tmp_path_factory.mktemp("verifier") / "v"
    run(tiny_llama, out)
    return out / "verifier.safetensors"


@given(data=st.data())
def test_safetensors_header(verifier_file, data):
    """verifier.safetensors with a damaged header (its length field, any JSON edit of the header, cut):
    every tensor, or one line naming the file."""
    from pipeline.ondisk.readers import read_safetensors

    raw = verifier_file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    entry = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "BOOL", "F8_E4M3", "X"]) | JSON,
            "shape": st.lists(st.integers(-2, 300), max_size=3) | JSON,
            "data_offsets": st.lists(st.integers(-1, len(body) + 10), min_size=2, max_size=2) | JSON,
        }
    )
    new_header = data.draw(edited(header, values=entry | JSON))
    text = json.dumps(new_header).encode()
    length = data.draw(st.just(len(text)) | st.integers(0, 2**64 - 1))
    cut = data.draw(st.integers(0, len(body)) | st.just(len(body)))
    with Case() as root:
        path = root / "verifier.safetensors"
        path.write_bytes(struct.pack("<Q", length) + text + body[:cut])
        before = snapshot(root)
        try:
            tensors = read_safetensors(path, "run `pipeline weights --overwrite`")
        except StageError as exc:
            assert str(path) in refusal(exc)
        else:
            import torch

            assert all(isinstance(t, torch.Tensor) for t in tensors.values())
        assert snapshot(root) == before


# ---------------------------------------------------------------- the prepared set


NPY = st.builds(
    lambda dtype, shape, fill: np.full(shape, fill).astype(dtype),  # -1 wraps in an unsigned dtype
    st.sampled_from([np.int32, np.int64, np.uint8, np.float32, np.bool_, np.int8]),
    st.lists(st.integers(0, 5), min_size=0, max_size=2).map(tuple),
    st.integers(-3, 127),
)


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@given(data=st.data(), which=st.sampled_from(["metadata.json", "tokens.npy", "loss_mask.npy", "offsets.npy"]))
def test_prepared_set(prepared_llama, data, which):
    """One of the prepared set's files damaged (any JSON edit, another array, cut, bytes): samples whose
    offsets start at 0, never decrease and end at the tokens' count, with a mask as long as the tokens and
    as many samples as metadata.json says; or one line naming the set."""
    from pipeline.ondisk.formats import read_prepared

    valid = (prepared_llama / which).read_bytes()
    obj = json.loads(valid) if which.endswith(".json") else None
    strategy = document(valid, obj)
    if which.endswith(".npy"):
        real = np.load(prepared_llama / which)
        strategy = (
            strategy | NPY.map(_npy_bytes) | st.integers(0, len(real)).map(lambda k: _npy_bytes(real[:k]))
        )
        if which == "offsets.npy":
            strategy = strategy | st.permutations(list(real[:6])).map(
                lambda p: _npy_bytes(np.concatenate([np.array(p, dtype=real.dtype), real[6:]]))
            )
    content = data.draw(strategy)
    case = Case((prepared_llama, "prepared"))
    with case as root:
        (root / "prepared" / which).write_bytes(content)
        before = snapshot(root)
        try:
            samples, meta = read_prepared(root / "prepared")
        except StageError as exc:
            assert "prepared" in refusal(exc)
        else:
            off = np.asarray(samples.offsets)
            assert off[0] == 0 and (np.diff(off) >= 0).all() and off[-1] == len(samples.tokens)
            assert len(samples.loss_mask) == len(samples.tokens) and len(samples) == meta.num_samples
        case.check_unchanged(before)


# ---------------------------------------------------------- hidden states: data_i.pt, data_config, checksums


@pytest.fixture(scope="module")
def small_set(tmp_path_factory, extracted_llama):
    """A 2-sample copy of the session's extract (data_0, data_1 and its index files)."""
    d = tmp_path_factory.mktemp("small") / "states"
    d.mkdir()
    for name in ("data_0.pt", "data_1.pt", "data_config.json", "sample_lengths.json"):
        shutil.copy2(extracted_llama / name, d / name)
    cfg = json.loads((d / "data_config.json").read_text())
    cfg["num_samples"] = 2
    (d / "data_config.json").write_text(json.dumps(cfg))
    lengths = json.loads((d / "sample_lengths.json").read_text())
    (d / "sample_lengths.json").write_text(json.dumps({k: v for k, v in lengths.items() if k in ("0", "1")}))
    return d


def _sample_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _tensor():
    import torch

    return st.builds(
        lambda dtype, shape: torch.zeros(shape, dtype=dtype),
        st.sampled_from(["float32", "float16", "int64", "int32", "bool"]).map(
            lambda n: getattr(__import__("torch"), n)
        ),
        st.lists(st.integers(0, 4), max_size=3).map(tuple),
    )


@given(data=st.data())
def test_data_file(small_set, data):
    """data_0.pt replaced (cut, bytes, a torch file of other keys, dtypes, shapes or kinds), judged by every
    per-file check of verify (``damaged_files``, what `verify` and `--repair` run): a failed check in one
    line, or a sample of the set's form; never an exception; nothing written."""
    import torch

    from pipeline.ondisk.formats import read_data_config, read_sample
    from pipeline.ondisk.integrity import damaged_files

    valid = (small_set / "data_0.pt").read_bytes()
    value = st.one_of(
        _tensor(), st.lists(_tensor(), max_size=5), st.integers(), st.text(max_size=4), st.none()
    )
    fake = st.dictionaries(
        st.sampled_from(["input_ids", "hidden_states", "loss_mask", "other"]), value, max_size=4
    ).map(_sample_bytes)
    content = data.draw(document(valid) | fake | value.map(_sample_bytes))
    case = Case((small_set / "data_config.json", "data_config.json"))
    with case as root:
        states = root  # only what judging data_0 reads: the file and the set's config
        (states / "data_0.pt").write_bytes(content)
        before = snapshot(root)
        dc = read_data_config(states)
        found = damaged_files(states, [0], dc, prepared=None, workers=1)
        if 0 in found:
            refusal(found[0])
        else:
            d = read_sample(states / "data_0.pt")
            assert d["input_ids"].dtype == torch.int64 and len(d["hidden_states"]) == len(dc.layer_ids)
            assert all(h.shape == (len(d["input_ids"]), dc.hidden_size) for h in d["hidden_states"])
        case.check_unchanged(before)


@given(data=st.data())
def test_data_config(small_set, data):
    """data_config.json, any damage: a config with a known dtype, positive sizes and distinct layer ids,
    or one line naming the file."""
    from pipeline.ondisk.formats import data_config_problems, read_data_config

    valid = (small_set / "data_config.json").read_bytes()
    content = data.draw(document(valid, json.loads(valid)))
    case = Case((small_set, "states"))
    with case as root:
        (root / "states" / "data_config.json").write_bytes(content)
        before = snapshot(root)
        try:
            config = read_data_config(root / "states")
        except StageError as exc:
            assert "data_config.json" in refusal(exc)
        else:
            assert data_config_problems(config) == []
        case.check_unchanged(before)


@given(
    data=st.data(),
    journal=st.lists(st.binary(max_size=40) | JSON.map(lambda v: json.dumps(v).encode()), max_size=3),
)
def test_checksums(small_set, data, journal):
    """checksums.json and a journal, any content: the entries read are sha256 texts and sizes of named
    files, or none (verify then reports the index); never an exception."""
    from pipeline.ondisk.formats import read_checksums

    valid = {
        "schema": "eagle-ops.checksums",
        "version": 2,
        "files": {"data_0.pt": {"sha256": "0" * 64, "bytes": 1, "mtime_ns": 1}},
    }
    content = data.draw(document(json.dumps(valid).encode(), valid))
    case = Case((small_set, "states"))
    with case as root:
        (root / "states" / "checksums.json").write_bytes(content)
        (root / "states" / "checksums.h.1.journal").write_bytes(b"\n".join(journal))
        before = snapshot(root)
        found = read_checksums(root / "states")
        for name, digest in found.items():
            assert isinstance(name, str) and isinstance(digest.sha256, str) and isinstance(digest.bytes, int)
        case.check_unchanged(before)


# ---------------------------------------------------------------- numeric and path options


def _numeric_options() -> list[tuple[str, str, object]]:
    import dataclasses
    import importlib
    import typing

    from pipeline.cli import COMMANDS
    from pipeline.options import _base_type, config_of, flag_of, spec_of

    out = []
    for stage, target in sorted(COMMANDS.items()):
        module, attr = target.split(":")
        cls = config_of(getattr(importlib.import_module(module), attr))
        if cls is None:
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            base = _base_type(hints[f.name])
            if spec_of(f).cli and base in (int, float, Path):
                out.append((stage, "PATH" if spec_of(f).argument else flag_of(f), base))
    return out


REQUIRED = {
    "prepare": ["--data", "d.jsonl", "--model", "m", "--out", "o"],
    "extract": ["--prepared", "p", "--model", "m", "--out", "o"],
    "weights": ["--model", "m", "--out", "o"],
    "verify": ["states"],
    "train": ["--data", "s", "--verifier", "v", "--out", "o"],
    "regenerate": ["--data", "d.jsonl", "--out", "o", "--endpoint", "http://127.0.0.1:8000/v1"],
    "evaluate": ["--model", "m", "--draft", "t", "--prompts", "p.jsonl", "--out", "o"],
}
NUMBER_TEXT = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "-inf", "inf", "1e309", "-0", "0x10", "1_000", "", " 3", "3.0", "1e3", "½", "٣"]),
    st.text(max_size=6),
)
PATH_TEXT = st.lists(
    st.sampled_from(["loop-a", "file.txt", "dir", "..", ".", "missing", "x" * 300, "a b", "é", "-"]),
    min_size=1,
    max_size=4,
).map(lambda parts: "/".join(parts))


@given(option=st.sampled_from(_numeric_options()), data=st.data())
def test_numeric_and_path_options(tmp_path_factory, monkeypatch, capsys, option, data):
    """Any text for any numeric or path option of any stage, through `pipeline check-args` (the stage's
    own parse and config checks): accepted with a value in the option's declared range, or refused in one
    line (exit 2); nothing written anywhere."""
    import dataclasses
    import importlib
    import math

    from pipeline.cli import COMMANDS
    from pipeline.options import config_of, flag_of, spec_of

    stage, flag, base = option
    value = data.draw(PATH_TEXT if base is Path else NUMBER_TEXT)
    with Case() as root:
        (root / "loop-a").symlink_to(root / "loop-b")
        (root / "loop-b").symlink_to(root / "loop-a")
        (root / "file.txt").write_text("x")
        (root / "dir").mkdir()
        args = list(REQUIRED[stage])
        if flag == "PATH":
            args[0] = str(root / value)
        else:
            args += [flag, value if base is not Path else str(root / value)]
        before = snapshot(root)
        cwd = os.getcwd()
        os.chdir(root)
        try:
            rc, out, err = run_cli(monkeypatch, capsys, "check-args", stage, *args)
        finally:
            os.chdir(cwd)
        assert snapshot(root) == before
    assert rc in (0, 2) and not err, (rc, err)
    line = out.strip()
    assert "\n" not in line and line.startswith("ok   arguments:" if rc == 0 else "FAIL arguments:"), out
    if rc == 2:
        return
    if base is not Path:
        module, attr = COMMANDS[stage].split(":")
        cls = config_of(getattr(importlib.import_module(module), attr))
        f = next(f for f in dataclasses.fields(cls) if flag_of(f) == flag)
        spec = spec_of(f)
        number = float(value.replace("_", ""))
        assert math.isfinite(number), (flag, value)
        if spec.low is not None:
            assert number >= spec.low, (flag, value)
        if spec.high is not None:
            assert number <= spec.high, (flag, value)


# --------------------------------------------------------- failures the generator found, kept as plain tests


def test_found_tokenizer_config_whose_max_length_is_not_a_number(
    tmp_path, monkeypatch, capsys, tiny_llama, conversations
):
    """tokenizer_config.json with ``model_max_length: []`` loaded without complaint and broke the first
    encode (a TypeError per row in prepare): now prepare refuses the tokenizer in one line."""
    model = tmp_path / "model"
    model.mkdir()
    for p in tiny_llama.iterdir():
        (model / p.name).symlink_to(p)
    cfg = json.loads((tiny_llama / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = []
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli(
        monkeypatch, capsys, "prepare", "--data", conversations, "--model", model, "--out", tmp_path / "p"
    )
    assert rc == 2 and refusal(err).startswith(f"error: cannot load the tokenizer from {model}"), err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("name", "damage", "fragment"),
    [
        ("offsets.npy", lambda a: a[:0], "offsets.npy does not run from 0"),
        ("loss_mask.npy", lambda a: a[:0], "loss_mask.npy (uint8[0]) does not match tokens.npy"),
        ("offsets.npy", lambda a: np.concatenate([a[1:3], a[:1], a[3:]]), "offsets.npy does not run from 0"),
        ("tokens.npy", lambda a: a.astype(np.float32), "both must hold integers"),
    ],
)
def test_found_prepared_arrays_that_disagree(tmp_path, prepared_llama, name, damage, fragment):
    """An empty offsets.npy (was: ValueError from len()), an empty loss_mask (was: accepted), offsets out of
    order (was: accepted), float tokens: one line naming the set."""
    from pipeline.ondisk.formats import read_prepared

    d = tmp_path / "prepared"
    shutil.copytree(prepared_llama, d)
    np.save(d / name, damage(np.load(prepared_llama / name)))
    with pytest.raises(StageError) as info:
        read_prepared(d)
    assert fragment in refusal(info.value) and str(d) in str(info.value)


def test_found_npy_header_cut_inside_its_dict(tmp_path, prepared_llama):
    """An offsets.npy whose header dict is cut by a NUL byte: numpy's header parser raised tokenize's
    TokenError, which the reader did not take for a damaged file."""
    from pipeline.ondisk.formats import read_prepared

    d = tmp_path / "prepared"
    shutil.copytree(prepared_llama, d)
    raw = bytearray((d / "offsets.npy").read_bytes())
    raw[64] = 0
    (d / "offsets.npy").write_bytes(bytes(raw))
    with pytest.raises(StageError, match="offsets.npy: not a readable .npy array"):
        read_prepared(d)


def test_found_checksum_journal_line_that_is_not_an_object(tmp_path):
    """A journal line holding ``{"file": "data_0.pt", ...}`` whose entry is null, or a bare ``null``, is no
    entry (was: AttributeError out of read_checksums, so out of verify and resume)."""
    from pipeline.ondisk.formats import read_checksums

    (tmp_path / "checksums.h.1.journal").write_text(
        'null\n[1]\n"x"\n{"file": "data_0.pt", "sha256": "a", "bytes": 1}\n'
    )
    found = read_checksums(tmp_path)
    assert list(found) == ["data_0.pt"] and found["data_0.pt"].bytes == 1


@pytest.mark.parametrize(
    ("sample", "check"),
    [
        ({"input_ids": None, "loss_mask": None, "hidden_states": []}, "input_ids a NoneType"),
        ("states-list", "hidden_states[1] is a list, expected a tensor"),
    ],
)
def test_found_data_file_of_the_right_keys_and_other_values(states, monkeypatch, capsys, sample, check):
    """A data_{i}.pt with the three keys but a None, or a list where a tensor belongs: verify fails a
    named check (exit 3) instead of an AttributeError traceback."""
    import torch

    d = torch.load(states / "data_3.pt", weights_only=True)
    if sample == "states-list":
        d["hidden_states"][1] = [1, 2]
        sample = d
    torch.save(sample, states / "data_3.pt")
    rc, _, err = run_cli(monkeypatch, capsys, "verify", states)
    assert rc == 3 and "data_3.pt" in refusal(err), err
    assert check in (states / "summary.json").read_text()  # the line names the first failed check


def test_found_data_file_whose_format_version_record_is_damaged(small_set):
    """Three zero bytes in the zip header of data_0.pt's ``.format_version`` record (found by make fuzz):
    verify's fast reader never read that record and passed the file, which torch.load (speculators' loader,
    train) refuses; now the file fails check ``loadable``."""
    from pipeline.ondisk.formats import read_data_config
    from pipeline.ondisk.integrity import damaged_files

    raw = bytearray((small_set / "data_0.pt").read_bytes())
    raw[582:585] = b"\0\0\0"
    case = Case((small_set / "data_config.json", "data_config.json"))
    with case as root:
        (root / "data_0.pt").write_bytes(bytes(raw))
        found = damaged_files(root, [0], read_data_config(root), prepared=None, workers=1)
        assert found[0].startswith(
            "loadable: cannot load: RuntimeError: PytorchStreamReader failed reading"
        ), found


def test_found_data_file_whose_pickle_claims_another_storage_size(small_set):
    """One byte of data_0.pt's pickle changed so that a storage claims 4 bytes more than its record holds
    (found by make fuzz): verify's fast reader made a view of the claimed size and passed the file, which
    torch.load refuses ("record size ... does not match expected size"); now it fails check ``loadable``."""
    from pipeline.ondisk.formats import read_data_config, read_sample
    from pipeline.ondisk.integrity import damaged_files

    raw = bytearray((small_set / "data_0.pt").read_bytes())
    raw[295:296] = b"\x01"
    case = Case((small_set / "data_config.json", "data_config.json"))
    with case as root:
        (root / "data_0.pt").write_bytes(bytes(raw))
        with pytest.raises(RuntimeError, match="does not match expected size"):
            read_sample(root / "data_0.pt")  # what torch.load says of this file
        found = damaged_files(root, [0], read_data_config(root), prepared=None, workers=1)
        assert found[0].startswith("loadable: cannot load: RuntimeError: record size"), found
