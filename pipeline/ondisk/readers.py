"""One way to read each kind of file the pipeline reads, and what a damaged one is reported as.

Owns reading config.json, the tokenizer, the safetensors index and shards, our own index files
(metadata.json, data_config.json, sample_lengths.json), arrays (tokens.npy, d2t.npy, ...) and torch
files (token_freq.pt): every reader either returns a value of the documented shape or raises a
StageError of one line, ``PATH: what is wrong (what to do)``. The CLI turns that into exit 2; verify
turns it into a failed, named check. File names and layouts stay pipeline/ondisk/formats.py's.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

import numpy as np

from pipeline.errors import StageError

MODEL_REMEDY = "re-download or re-save the model directory"
PREPARED_REMEDY = "re-run `pipeline prepare --overwrite`"
STATES_REMEDY = "re-run `pipeline extract --overwrite`, or `--resume --repair`"
INDEX = "model.safetensors.index.json"


def damaged(path: Path | str, wrong: str, remedy: str) -> StageError:
    """The one error of every reader: the file, what is wrong with it, what to do."""
    return StageError(f"{path}: {wrong} ({remedy})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------- JSON


def read_json(path: Path, remedy: str, *, expect: type = dict) -> object:
    """A JSON file whose top level is ``expect`` (dict or list)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise damaged(path, "not found", remedy) from None
    except IsADirectoryError:
        raise damaged(path, "is a directory, not a file", remedy) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise damaged(path, f"not UTF-8 text (byte {exc.start})", remedy) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        what = "empty" if not text.strip() else f"not valid JSON ({exc.msg} at line {exc.lineno})"
        raise damaged(path, what, remedy) from None
    if not isinstance(obj, expect):
        raise damaged(path, f"is a JSON {_json_kind(obj)}, expected an {_json_kind(expect())}", remedy)
    return obj


def _json_kind(obj: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(obj), "number"
    )


def _matches(value: object, hint: object) -> bool:
    """Whether a JSON value has the type a dataclass field declares (int, str, bool, float, list, dict,
    X | None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    base = origin or hint
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is list and isinstance(value, list):
        (item,) = typing.get_args(hint) or (object,)
        return item is object or all(_matches(v, item) for v in value)
    return isinstance(value, base) if isinstance(base, type) else True


def read_record(path: Path, cls: type, remedy: str):
    """A JSON object read into dataclass ``cls``: required fields present, every known field of its type."""
    raw = read_json(path, remedy)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [n for n in required if n not in raw]
    if missing:
        raise damaged(path, f"lacks {', '.join(missing)}", remedy)
    bad = [
        f"{n} is {_json_kind(raw[n])} {raw[n]!r:.40}"
        for n in fields
        if n in raw and not _matches(raw[n], hints[n])
    ]
    if bad:
        raise damaged(path, f"wrong value types: {'; '.join(bad)}", remedy)
    return cls(**{k: v for k, v in raw.items() if k in fields})


def read_int_map(path: Path, remedy: str) -> dict[int, int]:
    """A JSON object of decimal integer keys to integers (sample_lengths.json)."""
    raw = read_json(path, remedy)
    try:
        out = {int(k): v for k, v in raw.items()}
    except ValueError:
        raise damaged(path, "has a key that is not an integer", remedy) from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in out.values()):
        raise damaged(path, "has a value that is not a non-negative integer", remedy)
    return out


# ---------------------------------------------------------------- model directory


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def read_model_config(path: Path) -> dict:
    """config.json of a model: an object whose decoder part (``text_config`` of a wrapper) has positive
    integer layer count, hidden size and vocab size, and whose other shape facts have their types."""
    raw = read_json(path, MODEL_REMEDY)
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise damaged(path, f"text_config is a JSON {_json_kind(text)}, expected an object", MODEL_REMEDY)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise StageError(f"{path} lacks {', '.join(missing)}: not a decoder-only language model config")
    bad = [
        f"{k} = {text[k]!r}"
        for k in ("num_hidden_layers", "hidden_size", "vocab_size")
        if not _positive_int(text[k])
    ]
    archs = raw.get("architectures", [])
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        bad.append(f"architectures = {archs!r:.40} (expected a list of names)")
    for where in (raw, text):
        tie = where.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):
            bad.append(f"tie_word_embeddings = {tie!r} (expected true or false)")
        for key in ("torch_dtype", "dtype", "model_type"):
            if where.get(key) is not None and not isinstance(where[key], str):
                bad.append(f"{key} = {where[key]!r} (expected a string)")
    if bad:
        raise damaged(
            path, f"wrong values: {'; '.join(dict.fromkeys(bad))}", "fix config.json or " + MODEL_REMEDY
        )
    return raw


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    """The model directory's tokenizer, proven by encoding a probe text; a missing or damaged tokenizer
    file is one line. The probe is the check: tokenizer_config.json can hold values of the wrong kind that
    load without complaint and break the first encode (``model_max_length: []``: a TypeError per row)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        ids = tokenizer("probe text")["input_ids"]
        if not all(isinstance(i, int) for i in ids):
            raise ValueError(f"encoding gives {type(ids[0]).__name__} ids, not integers")
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exception on a damaged file
        raise StageError(
            f"cannot load the tokenizer from {model_dir}: {_first_line(exc)} "
            f"(check tokenizer.json / tokenizer_config.json, or {MODEL_REMEDY})"
        ) from None
    return tokenizer


def read_weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or from a single model.safetensors."""
    index = model_dir / INDEX
    if index.is_file():
        raw = read_json(index, MODEL_REMEDY)
        wmap = raw.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise damaged(index, "is not a safetensors index (no weight_map object)", MODEL_REMEDY)
        bad = [k for k, v in wmap.items() if not isinstance(v, str) or not v or "/" in v or v in (".", "..")]
        if bad:
            raise damaged(
                index, f"weight_map[{bad[0]!r}] = {wmap[bad[0]]!r} is not a shard file name", MODEL_REMEDY
            )
        return dict(wmap)
    single = model_dir / "model.safetensors"
    if single.is_file():
        return dict.fromkeys(shard_tensor_names(single), single.name)
    raise StageError(f"{model_dir} has neither {INDEX} nor model.safetensors: not a safetensors checkpoint")


def shard_tensor_names(path: Path) -> list[str]:
    """The tensor names of one safetensors file (its header only)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return list(fh.keys())
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: a damaged header
        raise damaged(path, f"not a readable safetensors file ({_first_line(exc)})", MODEL_REMEDY) from None


def read_shard_tensors(model_dir: Path, wmap: dict[str, str], names: list[str]) -> dict:
    """The named tensors, each from the shard the weight map assigns it; a shard that is missing, damaged
    or lacks the tensor is named."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(wmap[n], []).append(n)
    tensors = {}
    for shard, shard_names in by_file.items():
        path = model_dir / shard
        if not path.is_file():
            raise damaged(path, f"shard listed in {INDEX} is missing", MODEL_REMEDY)
        try:
            with safe_open(str(path), framework="pt") as fh:
                present = set(fh.keys())
                absent = [n for n in shard_names if n not in present]
                if absent:
                    raise damaged(
                        path, f"has no tensor {absent[0]!r} although {INDEX} puts it there", MODEL_REMEDY
                    )
                for n in shard_names:
                    tensors[n] = fh.get_tensor(n)
        except StageError:
            raise
        except Exception as exc:  # noqa: BLE001 - truncated or random bytes
            raise damaged(
                path, f"not a readable safetensors file ({_first_line(exc)})", MODEL_REMEDY
            ) from None
    return tensors


def read_safetensors(path: Path, remedy: str) -> dict:
    """Every tensor of one safetensors file (verifier.safetensors)."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise damaged(path, "not found", remedy)
    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001
        raise damaged(path, f"not a readable safetensors file ({_first_line(exc)})", remedy) from None


# ---------------------------------------------------------------- arrays and torch files


def read_npy(path: Path, remedy: str, *, mmap: bool = False, ndim: int | None = 1) -> np.ndarray:
    """A ``.npy`` array (never a pickle), of ``ndim`` dimensions."""
    if not Path(path).is_file():
        raise damaged(path, "not found", remedy)
    try:
        array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - numpy parses a damaged header with tokenize (TokenError)
        # and ast, and reads its body with ValueError, EOFError, OSError or UnpicklingError: a damaged file
        raise damaged(path, f"not a readable .npy array ({_first_line(exc)})", remedy) from None
    if not isinstance(array, np.ndarray):
        raise damaged(path, f"holds a {type(array).__name__}, not one array", remedy)
    if ndim is not None and array.ndim != ndim:
        raise damaged(path, f"has shape {array.shape}, expected {ndim}-D", remedy)
    return array


def read_torch(path: Path, remedy: str) -> object:
    """A file written by ``torch.save``, loaded with torch's weights-only unpickler."""
    import torch

    if not Path(path).is_file():
        raise damaged(path, "not found", remedy)
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - RuntimeError, UnpicklingError, EOFError: a damaged file
        raise damaged(path, f"not a readable torch file ({_first_line(exc)})", remedy) from None


def read_token_freq(path: Path) -> dict[int, int]:
    """token_freq.pt: a dict of token id -> count, both non-negative integers."""
    freq = read_torch(path, PREPARED_REMEDY)
    if not isinstance(freq, dict):
        raise damaged(
            path, f"holds a {type(freq).__name__}, expected a dict of token id -> count", PREPARED_REMEDY
        )
    ok = all(isinstance(k, int) and isinstance(v, int) and k >= 0 and v >= 0 for k, v in freq.items())
    if not ok:
        raise damaged(path, "has an entry that is not a non-negative integer id -> count", PREPARED_REMEDY)
    return freq
