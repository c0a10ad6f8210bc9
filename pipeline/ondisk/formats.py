"""The on-disk contract between stages (DESIGN.md section 4); pipeline/interop.py converts it to speculators'.

Owns every file name and layout that one stage writes and another reads:

prepared dir (``prepare``)::

    tokens.npy       int32[total]      all samples' token ids, concatenated
    loss_mask.npy    uint8[total]      1 on assistant tokens
    offsets.npy      int64[N + 1]      sample i is tokens[offsets[i]:offsets[i+1]]
    metadata.json    tokenizer, model, seq_length, counts, format version
    token_freq.pt    dict[int, int]    counts over tokens with loss_mask == 1
    d2t.npy          int64[draft_vocab]  target id = i + d2t[i]
    t2d.npy          bool[target_vocab]  sum == draft_vocab

hidden-states dir (``extract``)::

    data_{i}.pt           {"input_ids": int64[T], "hidden_states": [4 x dtype[T, H]], "loss_mask": int64[T]}
    data_config.json      model, layer ids, hidden size, dtype, sample count, format version, provenance
    sample_lengths.json   {"0": T0, "1": T1, ...}
    checksums.json        {"schema": "eagle-ops.checksums", "version": 2, "algorithm": "sha256",
                           "files": {"data_0.pt": {"sha256": HEX, "bytes": N, "mtime_ns": M,
                                                   "facts": {...}}, ...}}
    checksums.HOST.PID.journal  one {"file", "sha256", "bytes", "mtime_ns", "facts"} JSON line per file a
                          running extract wrote

verifier dir (``weights``)::

    verifier.safetensors  embed_tokens.weight, norm.weight, lm_head.weight of the target
    verifier.json         their source names, shapes and dtype, the source dir

Why ``data_{i}.pt`` and not vLLM's ``hs_{i}.safetensors`` (what speculators 0.9's own ``speculators train``
reads, next to an Arrow dataset holding the loss masks): each data file carries its own ids and loss mask,
which ``extract --resume``, ``verify`` (``prepared_match``) and our train rely on without a second source;
size is the same to 0.03% and checksums work the same for both. The speculators contract is reached losslessly
through pipeline/interop.py (``export-speculators``; ``import-speculators`` for vLLM-native sets), whose
files are exactly vLLM's; docs/train.md has the contract, the converter's guarantees and when to switch.

Checksums: each data file's sha256 is computed by ``write_sample`` from the bytes as they are written (no
second read) and appended to the writing process's journal once the file has its final name, so that an
interrupted run keeps the checksums of every file it finished; at the end of a run the journals are folded
into ``checksums.json`` (``checksums.rank{R}-of-{W}.json`` for one host of several, so that hosts sharing a
directory never rewrite each other's index), written atomically. Readers take the union of the index files
and the journals (a journal line appended after an index wins). Why an index and journals rather than a
sidecar per file: one small file to copy and compare, no doubling of the file count of a million-sample
set, and no per-file extra write; the journals exist only while a run is in progress or was interrupted.
Version 2 adds to each entry the file's mtime once it had its final name (``mtime_ns``) and the value facts
its writer computed from the tensors in hand (``facts``: shapes, dtypes, non-finite counts, layer scale,
a digest of the ids and mask; built and judged by integrity.py, opaque here), which extract's closing check
judges instead of reading the file back; version 1 entries (sha256 and bytes only) are still read.

Summaries: every ``summary.json`` (verify's; train's through ``provenance.stamp``) carries the header of
contract/summary.py (schema and version, which ops reads too) and a ``provenance`` record next to its stage
keys; the provenance record's fields are listed in pipeline/ondisk/provenance.py.

Nothing else in the project writes these files; this module does no computation beyond (de)serialising.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import socket
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.ondisk import readers
from pipeline.ondisk.atomic import atomic_path, write_json
from pipeline.errors import StageError

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
CHECKSUM_SCHEMA = "eagle-ops.checksums"
CHECKSUM_VERSION = 2  # what this product writes: 2 added mtime_ns and facts to each entry
CHECKSUM_READ_VERSIONS = (1, 2)

PREPARED_FILES = ("tokens.npy", "loss_mask.npy", "offsets.npy", "metadata.json")
TOKEN_FREQ = "token_freq.pt"
D2T = "d2t.npy"
T2D = "t2d.npy"
DATA_CONFIG = "data_config.json"
SAMPLE_LENGTHS = "sample_lengths.json"
CHECKSUMS = "checksums.json"
CHECKSUM_INDEX_GLOB = "checksums*.json"
CHECKSUM_JOURNAL_GLOB = "checksums.*.journal"
DATA_FILE_RE = re.compile(r"^data_(\d+)\.pt$")
DATA_KEYS = ("input_ids", "hidden_states", "loss_mask")
VERIFIER_FILE = "verifier.safetensors"
VERIFIER_META = "verifier.json"
VERIFIER_KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


def data_file(directory: Path, index: int) -> Path:
    return directory / f"data_{index}.pt"


def load_verifier(directory: Path) -> dict:
    """The verifier's three tensors (``pipeline weights``' output), by their VERIFIER_KEYS names."""
    return readers.read_safetensors(directory / VERIFIER_FILE, "run `pipeline weights --overwrite`")


# ---------------------------------------------------------------- prepared samples


@dataclass(frozen=True)
class PreparedSamples:
    """Token ids and loss masks of N samples, held as three flat arrays."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def ids(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def mask(self, i: int) -> np.ndarray:
        return self.loss_mask[self.offsets[i] : self.offsets[i + 1]]

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], list[int]]]) -> PreparedSamples:
        lengths = [len(ids) for ids, _ in rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for ids, _ in rows for t in ids), dtype=np.int32, count=int(offsets[-1]))
        mask = np.fromiter((m for _, ms in rows for m in ms), dtype=np.uint8, count=int(offsets[-1]))
        return cls(tokens, mask, offsets)


@dataclass
class PreparedMetadata:
    """What ``prepare`` produced, and from what."""

    model: str
    seq_length: int
    max_tokens: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    target_vocab_size: int
    draft_vocab_size: int | None
    source: str
    mask_method: str
    skipped_rows: int = 0
    truncated_rows: int = 0
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)  # pipeline/ondisk/provenance.py: how this output was made


def _save_npy(target: Path, array: np.ndarray) -> None:
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, array)


def write_prepared(directory: Path, samples: PreparedSamples, metadata: PreparedMetadata) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _save_npy(directory / "tokens.npy", samples.tokens)
    _save_npy(directory / "loss_mask.npy", samples.loss_mask)
    _save_npy(directory / "offsets.npy", samples.offsets)
    write_json(directory / "metadata.json", asdict(metadata))  # last: its presence marks completeness


def is_prepared_dir(directory: Path) -> bool:
    return (directory / "metadata.json").is_file() and (directory / "offsets.npy").is_file()


def read_prepared(directory: Path) -> tuple[PreparedSamples, PreparedMetadata]:
    directory = Path(directory)
    missing = [n for n in PREPARED_FILES if not (directory / n).is_file()]
    if missing:
        raise StageError(
            f"{directory} is not a prepared dataset: missing {', '.join(missing)} (run `pipeline prepare`)"
        )
    metadata = readers.read_record(directory / "metadata.json", PreparedMetadata, readers.PREPARED_REMEDY)
    if metadata.format_version != FORMAT_VERSION:
        raise StageError(
            f"{directory}/metadata.json has format_version {metadata.format_version}, "
            f"expected {FORMAT_VERSION}"
        )
    samples = PreparedSamples(
        tokens=readers.read_npy(directory / "tokens.npy", readers.PREPARED_REMEDY, mmap=True),
        loss_mask=readers.read_npy(directory / "loss_mask.npy", readers.PREPARED_REMEDY, mmap=True),
        offsets=readers.read_npy(directory / "offsets.npy", readers.PREPARED_REMEDY),
    )
    wrong = prepared_problems(samples, metadata)
    if wrong:
        raise StageError(f"{directory}: {wrong} (re-run `pipeline prepare --overwrite`)")
    return samples, metadata


def prepared_problems(samples: PreparedSamples, metadata: PreparedMetadata) -> str | None:
    """What makes the arrays of a prepared set disagree with each other or with metadata.json, or None:
    integer tokens, a mask as long as the tokens, offsets that start at 0, never decrease and end at the
    tokens' count, one sample per offset after the first."""
    tokens, mask, offsets = samples.tokens, samples.loss_mask, samples.offsets
    if tokens.dtype.kind not in "iu" or offsets.dtype.kind not in "iu":
        return f"tokens.npy is {tokens.dtype}, offsets.npy {offsets.dtype}: both must hold integers"
    if mask.dtype.kind not in "iub" or len(mask) != len(tokens):
        return f"loss_mask.npy ({mask.dtype}[{len(mask)}]) does not match tokens.npy ({len(tokens)} tokens)"
    if len(offsets) == 0 or offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != len(tokens):
        return "offsets.npy does not run from 0 up to the tokens' count"
    if len(offsets) - 1 != metadata.num_samples:
        return f"offsets.npy holds {len(offsets) - 1} samples, metadata.json says {metadata.num_samples}"
    return None


# ---------------------------------------------------------------- vocab mapping and token frequencies


def write_token_freq(target: Path, freq: dict[int, int]) -> None:
    import torch

    with atomic_path(target) as tmp:
        with open(tmp, "wb") as fh:
            torch.save(freq, fh)


def read_token_freq(path: Path) -> dict[int, int]:
    return readers.read_token_freq(path)


def write_vocab(directory: Path, d2t: np.ndarray, t2d: np.ndarray) -> None:
    _save_npy(directory / D2T, d2t.astype(np.int64))
    _save_npy(directory / T2D, t2d.astype(bool))


def read_vocab(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    for name in (D2T, T2D):
        if not (directory / name).is_file():
            raise StageError(f"{directory / name} not found (run `pipeline prepare --draft-vocab-size N`)")
    return (
        readers.read_npy(directory / D2T, readers.PREPARED_REMEDY, ndim=None),
        readers.read_npy(directory / T2D, readers.PREPARED_REMEDY, ndim=None),
    )


# ---------------------------------------------------------------- hidden states


@dataclass
class DataConfig:
    """Describes a hidden-states directory; written by ``extract``."""

    model: str
    layer_ids: list[int]
    num_layers: int
    hidden_size: int
    dtype: str
    num_samples: int
    seq_length: int
    prepared: str
    backend: str
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)  # the run that last wrote this directory
    provenance_history: list = field(default_factory=list)  # earlier runs' records (a resumed set)


def states_config(
    model,
    layer_ids,
    dtype,
    num_samples: int,
    seq_length: int,
    prepared: Path,
    backend: str,
    provenance: dict,
    extra: dict | None = None,
) -> DataConfig:
    """The data config of a states set captured from ``model`` (a model folder as read by
    pipeline/model/modeldir.py) in ``dtype``: what extract and online training's states write alike (pure)."""
    return DataConfig(
        model=str(model.path.resolve()),
        layer_ids=list(layer_ids),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        dtype=str(dtype).removeprefix("torch."),
        num_samples=num_samples,
        seq_length=seq_length,
        prepared=str(Path(prepared).resolve()),
        backend=backend,
        extra=extra or {},
        provenance=provenance,
    )


def write_data_config(directory: Path, config: DataConfig) -> None:
    write_json(directory / DATA_CONFIG, asdict(config))


# what a resumed run's data_config.json must share with the run resuming it (extract --resume, train's states)
RESUME_KEYS = ("model", "layer_ids", "hidden_size", "dtype", "num_samples", "seq_length", "prepared")


def resume_mismatch(found: DataConfig, expected: DataConfig) -> str | None:
    """The first of ``RESUME_KEYS`` on which an existing set's config and this run's differ, said as
    ``key=found!r`` against ``expected!r``; None when the run may continue the set."""
    for k in RESUME_KEYS:
        if getattr(found, k) != getattr(expected, k):
            return f"{k}={getattr(found, k)!r} but this run has {getattr(expected, k)!r}"
    return None


def read_data_config(directory: Path) -> DataConfig:
    path = directory / DATA_CONFIG
    if not path.is_file():
        raise StageError(
            f"{path} not found: {directory} is not a hidden-states directory (run `pipeline extract`)"
        )
    config = readers.read_record(path, DataConfig, readers.STATES_REMEDY)
    wrong = data_config_problems(config)
    if wrong:
        raise readers.damaged(path, "; ".join(wrong), readers.STATES_REMEDY)
    return config


# the names a hidden-states dtype may have in data_config.json: torch's floating dtypes, as extract and
# import-speculators write them (`str(dtype)` without "torch."); any other name is no dtype a reader knows
STATE_DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")


def data_config_problems(config: DataConfig) -> list[str]:
    """What in a data_config.json of the right types has no meaning: an unknown dtype name, a size that is
    not positive, layer ids that are not distinct non-negative integers. Empty when it has none."""

    def count(value: object, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    wrong = []
    if config.dtype not in STATE_DTYPES:
        wrong.append(f"dtype {config.dtype!r:.40} is not one of {', '.join(STATE_DTYPES)}")
    for name, low in (("hidden_size", 1), ("num_layers", 1), ("num_samples", 0), ("seq_length", 0)):
        if not count(getattr(config, name), low):
            wrong.append(f"{name} {getattr(config, name)!r:.40} is not an integer >= {low}")
    ids = config.layer_ids
    if not ids or not all(count(i, 0) for i in ids) or len(set(ids)) != len(ids):
        wrong.append(f"layer_ids {ids!r:.60} are not distinct non-negative integers")
    return wrong


class _WriteErrorRecorder:
    """A file wrapper that remembers the OSError of a failed write: torch.save turns it into an opaque
    RuntimeError, and a full disk must be reported as such."""

    def __init__(self, fh):
        self.fh = fh
        self.error: OSError | None = None
        self.hash = hashlib.sha256()  # of the bytes as written: the file's checksum without a second read
        self.size = 0

    def write(self, data) -> int:
        try:
            n = self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.hash.update(memoryview(data)[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self.fh.flush()


@dataclass(frozen=True)
class FileDigest:
    """A file's checksum as its writer computed it; in a record of version 2 also its mtime once complete
    and its value facts (None: not recorded, as in a version 1 record or a digest of a read)."""

    sha256: str
    bytes: int
    mtime_ns: int | None = field(default=None, compare=False)
    facts: dict | None = field(default=None, compare=False)

    def entry(self) -> dict:
        """The index/journal entry: sha256 and bytes, and the version 2 fields where known."""
        extra = {k: v for k, v in (("mtime_ns", self.mtime_ns), ("facts", self.facts)) if v is not None}
        return {"sha256": self.sha256, "bytes": self.bytes, **extra}


def _digest_of(entry: dict) -> FileDigest:
    """A checksum entry read back; TypeError, KeyError or ValueError for one that is not an entry."""
    if not isinstance(entry, dict):
        raise TypeError(f"a checksum entry is a JSON object, not {type(entry).__name__}")
    mtime, facts = entry.get("mtime_ns"), entry.get("facts")
    return FileDigest(
        str(entry["sha256"]),
        int(entry["bytes"]),
        int(mtime) if mtime is not None else None,
        facts if isinstance(facts, dict) else None,
    )


def write_sample(
    target: Path, input_ids: torch.Tensor, hidden_states: list[torch.Tensor], loss_mask: torch.Tensor
) -> FileDigest:
    """Write one ``data_{i}.pt`` atomically; return the sha256 and size of the bytes written. Tensors must own
    their storage (no views of a padded batch).

    Written through a file object, not a path: torch names the zip's records after a path's basename, and
    the temporary name would make reruns differ byte for byte. Zip CRC32s are not computed (they cost more
    than the write itself); truncation is still detected by the zip directory at load time.
    """
    import torch

    sample = {
        "input_ids": input_ids.to(torch.int64),
        "hidden_states": hidden_states,
        "loss_mask": loss_mask.to(torch.int64),
    }
    torch.serialization.set_crc32_options(False)
    with atomic_path(target, fsync=False) as tmp:
        with open(tmp, "wb") as fh:
            recorder = _WriteErrorRecorder(fh)
            try:
                torch.save(sample, recorder)
                fh.flush()
            except RuntimeError:
                if recorder.error is not None:
                    raise recorder.error from None
                raise
    return FileDigest(recorder.hash.hexdigest(), recorder.size)


class _SampleUnpickler(pickle.Unpickler):
    """The C unpickler, allowed only the globals a data file names: torch's tensor rebuild function and the
    empty OrderedDict of backward hooks (storage classes never reach here: torch resolves them itself).

    Any other global fails the load, as it would under ``weights_only=True``; unlike that unpickler, which
    is pure Python and holds the GIL for ~1-2 ms per file, this one costs ~0.6 ms: threads reading many
    files (verify's fallback, training) spend that time holding the GIL. It is not hardened against a file
    crafted to crash the C parser: data files are this project's own output, on the host that wrote them.
    """

    ALLOWED = frozenset({("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")})

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a data file")
        return super().find_class(module, name)


class _SamplePickle:
    """The ``pickle_module`` handed to ``torch.load``. Its ``load`` is reached only by torch's legacy
    (pre-zip) format, which this project never writes: refused rather than unpickled unrestricted."""

    __name__ = "pipeline.ondisk.formats.sample_pickle"
    Unpickler = _SampleUnpickler

    @staticmethod
    def load(*_args, **_kwargs):
        raise pickle.UnpicklingError("not a zip archive written by torch.save (legacy or foreign format)")


def weights_only_forced() -> bool:
    """Whether the operator forces torch's weights_only loader (TORCH_FORCE_WEIGHTS_ONLY_LOAD): honoured."""
    return os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def read_sample(path: Path, mmap: bool = False) -> dict:
    """One ``data_{i}.pt``, through ``_SampleUnpickler`` (or torch's ``weights_only`` loader where the
    operator forces it with TORCH_FORCE_WEIGHTS_ONLY_LOAD). ``mmap=True`` maps the file instead of reading
    it: loading then costs only the pickle, and the tensors' pages are read (in parallel, without the GIL)
    by whatever touches them."""
    import torch

    if weights_only_forced():
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    return torch.load(path, weights_only=False, pickle_module=_SamplePickle, map_location="cpu", mmap=mmap)


def existing_data_indices(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := DATA_FILE_RE.match(p.name)))


def write_sample_lengths(directory: Path, lengths: dict[int, int]) -> None:
    write_json(directory / SAMPLE_LENGTHS, {str(k): int(v) for k, v in sorted(lengths.items())})


def read_sample_lengths(directory: Path) -> dict[int, int]:
    path = directory / SAMPLE_LENGTHS
    return readers.read_int_map(path, readers.STATES_REMEDY) if path.is_file() else {}


# ---------------------------------------------------------------- checksums


def file_digest(path: Path) -> FileDigest:
    """A file's sha256 and size, read in 8 MiB blocks (hashlib releases the GIL on blocks this large)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as fh:
        while block := fh.read(8 << 20):
            h.update(block)
            size += len(block)
    return FileDigest(h.hexdigest(), size)


class ChecksumJournal:
    """The checksums of the data files one process wrote, appended one JSON line each once the file has its
    final name (a line therefore never names a file that is not complete). Thread-safe; opened on first
    use."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / f"checksums.{socket.gethostname()}.{os.getpid()}.journal"
        self._lock = threading.Lock()
        self._fh = None

    def record(self, name: str, digest: FileDigest) -> None:
        line = json.dumps({"file": name, **digest.entry()}) + "\n"
        with self._lock:
            if self._fh is None:
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held until close()
            self._fh.write(line)
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def _journal_entries(path: Path) -> dict[str, FileDigest]:
    entries = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return entries
    for line in lines:
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                continue  # a line of another kind: no entry
            entries[str(rec["file"])] = _digest_of(rec)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a crash mid-append: its file has no checksum, which verify reports
    return entries


def read_checksums(directory: Path) -> dict[str, FileDigest]:
    """Every recorded checksum in ``directory``: the index files, then the journals (oldest first), later
    records winning. Unreadable index files are skipped here; verify reports them (``checksum_index``)."""
    found: dict[str, FileDigest] = {}
    for path in sorted(Path(directory).glob(CHECKSUM_INDEX_GLOB)):
        found.update(read_checksum_index(path))
    journals = sorted(
        Path(directory).glob(CHECKSUM_JOURNAL_GLOB), key=lambda p: (p.stat().st_mtime_ns, p.name)
    )
    for path in journals:
        found.update(_journal_entries(path))
    return found


def read_checksum_index(path: Path) -> dict[str, FileDigest]:
    """One index file's entries; {} for a file that is not one (damaged, or of another schema)."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("schema") != CHECKSUM_SCHEMA or raw.get("version") not in CHECKSUM_READ_VERSIONS:
            return {}
        return {str(k): _digest_of(v) for k, v in raw["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def checksum_index_name(world_size: int, rank: int) -> str:
    return CHECKSUMS if world_size == 1 else f"checksums.rank{rank}-of-{world_size}.json"


def fold_checksums(directory: Path, owned: set[int], world_size: int = 1, rank: int = 0) -> int:
    """Write this host's index (atomically) from everything recorded for the data files it owns that exist,
    then delete the journals whose every line is about such a file; return the entries written."""
    directory = Path(directory)
    recorded = read_checksums(directory)
    present = {f"data_{i}.pt" for i in existing_data_indices(directory) if i in owned}
    files = {k: v.entry() for k, v in sorted(recorded.items()) if k in present}
    write_json(
        directory / checksum_index_name(world_size, rank),
        {"schema": CHECKSUM_SCHEMA, "version": CHECKSUM_VERSION, "algorithm": "sha256", "files": files},
    )
    for journal in directory.glob(CHECKSUM_JOURNAL_GLOB):
        names = _journal_entries(journal)
        if all((m := DATA_FILE_RE.match(n)) and int(m.group(1)) in owned for n in names):
            journal.unlink(missing_ok=True)
    return len(files)
