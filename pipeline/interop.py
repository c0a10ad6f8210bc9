"""Our sets <-> speculators 0.9's on-disk contract (``speculators train``), both ways, losslessly.

Owns the translation between our prepared dir + hidden-states dir (pipeline/ondisk/formats.py) and the
directory ``speculators train --data-path`` reads (docs/train.md, "speculators 0.9's on-disk contract"):

    DATA/                           a ``datasets`` dir (``save_to_disk``): columns input_ids int64[T],
                                    loss_mask int64[T], seq_len int64, torch format
    DATA/hidden_states/hs_{i}.safetensors   {"hidden_states": dtype[T, 4, H], "token_ids": int64[T]},
                                    vLLM 0.32's native extraction file (ExampleHiddenStatesConnector)
    DATA/token_freq.pt              dict[int, int], as ours
    DATA/d2t-{N}.npy, t2d-{N}.npy   the vocab mapping speculators picks up for ``--draft-vocab-size N``
    DATA/eagle-ops.json             ours, ignored by speculators: the records needed to come back losslessly
                                    and the ``speculators train`` arguments that fit this set

``export_speculators`` writes that from ours; ``import_speculators`` writes ours from it (a set exported
here, or one written by vLLM's native extraction + ``speculators prepare-data``). Hidden states keep their
dtype and bits (stacked on dim 1 one way, split the other); token ids and masks are widened/narrowed
without loss. Both build their output in a staging dir renamed into place (pipeline/ondisk/outdir.py),
refuse a non-empty --out without --overwrite, and raise one-line StageErrors. Not done here: checks of values
(``pipeline verify`` does those on the imported set).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import click

from pipeline.ondisk.paths import LoopCheckedPath
import numpy as np

from pipeline.ondisk import formats
from pipeline.ondisk.atomic import write_json
from pipeline.errors import StageError
from pipeline.model.layers import NUM_CAPTURED, parse_layer_ids, to_vllm_aux_ids, validate_layer_ids

HIDDEN_STATES_DIR = "hidden_states"
RECORD = "eagle-ops.json"
RECORD_SCHEMA = "eagle-ops.speculators-export"
RECORD_VERSION = 1
HS_FILE_RE = re.compile(r"^hs_(\d+)\.safetensors$")
VOCAB_RE = re.compile(r"^d2t-(\d+)\.npy$")
ARROW_CHUNK_ROWS = 65536  # rows per Arrow record batch: int32 list offsets stay far from overflow


def hs_file(directory: Path, index: int) -> Path:
    return directory / f"hs_{index}.safetensors"


def hs_indices(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := HS_FILE_RE.match(p.name)))


def speculators_train_args(data_config: formats.DataConfig, draft_vocab: int | None) -> list[str]:
    """The ``speculators train`` flags this set needs beyond the run's own (save path, epochs, ...)."""
    args = [
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        data_config.model,
        "--on-missing",
        "raise",
        "--target-layer-ids",
        *[str(k) for k in to_vllm_aux_ids(data_config.layer_ids)],
    ]
    if draft_vocab is not None:
        args += ["--draft-vocab-size", str(draft_vocab)]
    return args


# ---------------------------------------------------------------- ours -> speculators


def _check_sets(
    prepared: Path, data: Path
) -> tuple[formats.PreparedSamples, formats.PreparedMetadata, formats.DataConfig]:
    for flag, path in (("--prepared", prepared), ("--data", data)):
        if not path.is_dir():
            raise StageError(f"{flag} {path} is not a directory")
    samples, meta = formats.read_prepared(prepared)
    dc = formats.read_data_config(data)
    indices = formats.existing_data_indices(data)
    n = len(samples)
    if dc.num_samples != n or len(indices) != n or (indices and indices[-1] != n - 1):
        missing = sorted(set(range(n)) - set(indices))[:3]
        raise StageError(
            f"{data} does not match {prepared}: {n} prepared samples, "
            f"data_config.json says {dc.num_samples}, "
            f"{len(indices)} data files"
            + (f" (missing {', '.join(f'data_{i}.pt' for i in missing)})" if missing else "")
            + " (finish the set with `pipeline extract --resume`, "
            "or pass the prepared dir it was extracted from)"
        )
    return samples, meta, dc


def _arrow_table(ids: list[np.ndarray], masks: list[np.ndarray]):
    """input_ids / loss_mask / seq_len as speculators' prepare-data writes them, in record batches."""
    import pyarrow as pa

    batches = []
    for start in range(0, max(len(ids), 1), ARROW_CHUNK_ROWS):
        part_ids, part_masks = ids[start : start + ARROW_CHUNK_ROWS], masks[start : start + ARROW_CHUNK_ROWS]
        lengths = np.array([len(x) for x in part_ids], dtype=np.int64)
        offsets = np.zeros(len(part_ids) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        batches.append(
            pa.record_batch(
                {
                    "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(_flat_int64(part_ids))),
                    "loss_mask": pa.ListArray.from_arrays(
                        pa.array(offsets), pa.array(_flat_int64(part_masks))
                    ),
                    "seq_len": pa.array(lengths),
                }
            )
        )
    return pa.Table.from_batches(batches)


def _flat_int64(rows: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _save_dataset(table, out: Path) -> None:
    import datasets

    datasets.disable_progress_bars()  # stderr is a stage's one-line error
    dataset = datasets.Dataset(table)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))


def export_speculators(prepared: Path, data: Path, out: Path, *, overwrite: bool = False, log=print) -> dict:
    """Write ``out`` as ``speculators train --data-path`` reads it, from our prepared + hidden-states dirs."""
    import torch
    from safetensors.torch import save_file

    from pipeline.ondisk.outdir import staged_dir

    prepared, data, out = Path(prepared), Path(data), Path(out)
    samples, meta, dc = _check_sets(prepared, data)
    d2t = t2d = None
    if (prepared / formats.D2T).is_file() or (prepared / formats.T2D).is_file():
        d2t, t2d = formats.read_vocab(prepared)
    with staged_dir(out, overwrite=overwrite, inputs={"--prepared": prepared, "--data": data}) as staging:
        _save_dataset(
            _arrow_table(
                [samples.ids(i) for i in range(len(samples))], [samples.mask(i) for i in range(len(samples))]
            ),
            staging,
        )
        states = staging / HIDDEN_STATES_DIR
        states.mkdir()
        for i in range(len(samples)):
            path = formats.data_file(data, i)
            sample = _read_data_file(path)
            if not (
                np.array_equal(sample["input_ids"].numpy(), samples.ids(i))
                and np.array_equal(sample["loss_mask"].numpy(), samples.mask(i))
            ):
                raise StageError(
                    f"{path} does not hold prepared sample {i} of {prepared} (other tokens or loss "
                    "mask): re-extract it with `pipeline extract --repair`"
                )
            save_file(
                {
                    "hidden_states": torch.stack(sample["hidden_states"], dim=1).contiguous(),
                    "token_ids": sample["input_ids"].to(torch.int64).contiguous(),
                },
                str(hs_file(states, i)),
            )
        if (prepared / formats.TOKEN_FREQ).is_file():
            formats.write_token_freq(
                staging / formats.TOKEN_FREQ, formats.read_token_freq(prepared / formats.TOKEN_FREQ)
            )
        draft_vocab = None
        if d2t is not None:
            draft_vocab = int(d2t.shape[0])
            np.save(staging / f"d2t-{draft_vocab}.npy", d2t.astype(np.int64))
            np.save(staging / f"t2d-{draft_vocab}.npy", t2d.astype(bool))
        record = {
            "schema": RECORD_SCHEMA,
            "version": RECORD_VERSION,
            "data_config": asdict(dc),
            "prepared_metadata": asdict(meta),
            "speculators_train_args": speculators_train_args(dc, draft_vocab),
        }
        write_json(staging / RECORD, record)
    log(
        f"exported {len(samples)} samples -> {out}; train with: speculators train --data-path {out} "
        + " ".join(record["speculators_train_args"])
        + " --save-path DIR"
    )
    return record


def _read_data_file(path: Path) -> dict:
    try:
        sample = formats.read_sample(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one line naming it
        raise StageError(
            f"{path} is unreadable ({_first_line(exc)}); run `pipeline verify` on its set"
        ) from None
    if len(sample.get("hidden_states", ())) != NUM_CAPTURED:
        raise StageError(
            f"{path} does not hold {NUM_CAPTURED} captured layers: run `pipeline verify` on its set"
        )
    return sample


# ---------------------------------------------------------------- speculators -> ours


def _read_record(data: Path) -> dict | None:
    path = data / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StageError(
            f"{path} is unreadable ({_first_line(exc)}): delete it and pass --model and --layer-ids"
        ) from None
    if (
        not isinstance(record, dict)
        or record.get("schema") != RECORD_SCHEMA
        or record.get("version") != RECORD_VERSION
    ):
        raise StageError(f"{path} is not a version-{RECORD_VERSION} {RECORD_SCHEMA} record")
    return record


def _load_dataset(data: Path):
    import datasets

    datasets.disable_progress_bars()  # stderr is a stage's one-line error
    try:
        dataset = datasets.load_from_disk(str(data))
    except (OSError, ValueError) as exc:
        raise StageError(
            f"{data} is not a dataset written by `speculators prepare-data` ({_first_line(exc)})"
        ) from None
    missing = [c for c in ("input_ids", "loss_mask") if c not in dataset.column_names]
    if missing:
        raise StageError(
            f"{data}: dataset has no {', '.join(missing)} column (columns: {', '.join(dataset.column_names)})"
        )
    return dataset.with_format(None)


def _vocab_for(
    data: Path, draft_vocab: int | None, freq: dict[int, int], target_vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """The set's own d2t-N/t2d-N, else one built from its token frequencies, else the full vocab."""
    from pipeline.model.vocab import build_vocab_mapping

    sizes = sorted(int(m.group(1)) for p in data.glob("d2t-*.npy") if (m := VOCAB_RE.match(p.name)))
    if draft_vocab is None and len(sizes) == 1:
        draft_vocab = sizes[0]
    if draft_vocab is not None and draft_vocab in sizes and (data / f"t2d-{draft_vocab}.npy").is_file():
        return np.load(data / f"d2t-{draft_vocab}.npy"), np.load(data / f"t2d-{draft_vocab}.npy")
    if draft_vocab is not None and draft_vocab < target_vocab:
        return build_vocab_mapping(freq, target_vocab, draft_vocab)
    return np.zeros(target_vocab, dtype=np.int64), np.ones(target_vocab, dtype=bool)


def import_speculators(
    data: Path,
    out: Path,
    *,
    model: Path | None = None,
    layer_ids: list[int] | None = None,
    draft_vocab: int | None = None,
    hidden_states: Path | None = None,
    overwrite: bool = False,
    log=print,
) -> formats.DataConfig:
    """Write ``out/prepared`` and ``out/hidden_states`` (our contract) from a ``speculators train`` data dir.

    ``layer_ids`` are vLLM's ids as the set was extracted with (the three auxiliary ones, then the number of
    layers for the final state), needed only for a set this module did not export."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from pipeline.model.modeldir import read_model_dir
    from pipeline.ondisk.outdir import staged_dir
    from pipeline.model.vocab import token_frequencies

    data, out = Path(data), Path(out)
    if not data.is_dir():
        raise StageError(f"--data {data} is not a directory")
    states_in = Path(hidden_states) if hidden_states else data / HIDDEN_STATES_DIR
    record = _read_record(data)
    if record is None and (model is None or layer_ids is None):
        raise StageError(
            f"{data} has no {RECORD} (it was not exported by eagle-ops): pass --model (the target) and "
            "--layer-ids (vLLM's ids it was extracted with, the final one included)"
        )
    dataset = _load_dataset(data)
    n = len(dataset)
    indices = hs_indices(states_in)
    if len(indices) != n or (indices and indices[-1] != n - 1):
        missing = sorted(set(range(n)) - set(indices))[:3]
        raise StageError(
            f"{states_in} has {len(indices)} hs_*.safetensors files for {n} dataset rows"
            + (f" (missing {', '.join(f'hs_{i}.safetensors' for i in missing)})" if missing else "")
            + ": extract the missing rows, or pass the dataset they were extracted from"
        )
    if record is not None:
        dc = formats.DataConfig(**record["data_config"])
        meta = formats.PreparedMetadata(**record["prepared_metadata"])
    else:
        target = read_model_dir(model)
        if layer_ids[-1:] != [target.num_layers] or min(layer_ids) < 1:
            raise StageError(
                f"--layer-ids {','.join(map(str, layer_ids))}: vLLM's ids run 1..{target.num_layers} and "
                f"end with the final state, {target.num_layers}, for this {target.num_layers}-layer target"
            )
        ours = validate_layer_ids([k - 1 for k in layer_ids], target.num_layers)
        dc = formats.DataConfig(
            model=str(Path(model).resolve()),
            layer_ids=ours,
            num_layers=target.num_layers,
            hidden_size=target.hidden_size,
            dtype="",
            num_samples=n,
            seq_length=0,
            prepared="",
            backend="speculators-import",
        )
        meta = None
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    with staged_dir(
        out, overwrite=overwrite, inputs={"--data": data, "--hidden-states": states_in}
    ) as staging:
        prep_dir, states_dir = staging / "prepared", staging / "hidden_states"
        states_dir.mkdir(parents=True)
        journal = formats.ChecksumJournal(states_dir)
        lengths = {}
        for i in range(n):
            path = hs_file(states_in, i)
            try:
                hs = load_file(str(path))
            except (OSError, SafetensorError) as exc:
                raise StageError(f"{path} is unreadable ({_first_line(exc)}): re-extract it") from None
            row = dataset[i]
            ids, mask = (
                np.asarray(row["input_ids"], dtype=np.int64),
                np.asarray(row["loss_mask"], dtype=np.int64),
            )
            states, tokens = hs.get("hidden_states"), hs.get("token_ids")
            if states is None or tokens is None or states.ndim != 3 or states.shape[1] != NUM_CAPTURED:
                raise StageError(
                    f"{path} is not a vLLM hidden-states file with {NUM_CAPTURED} layers "
                    f"(keys {sorted(hs)}, shape {tuple(states.shape) if states is not None else None})"
                )
            if not np.array_equal(tokens.numpy().astype(np.int64), ids) or len(mask) != len(ids):
                raise StageError(
                    f"{path} does not hold dataset row {i} of {data} (other token ids): re-extract it"
                )
            if states.shape[0] != len(ids):
                raise StageError(
                    f"{path} has states for {states.shape[0]} tokens, its row {i} has {len(ids)}: "
                    "re-extract it"
                )
            layers = [states[:, j].clone(memory_format=torch.contiguous_format) for j in range(NUM_CAPTURED)]
            digest = formats.write_sample(
                formats.data_file(states_dir, i), torch.from_numpy(ids), layers, torch.from_numpy(mask)
            )
            journal.record(formats.data_file(states_dir, i).name, digest)
            lengths[i] = len(ids)
            rows.append((ids.astype(np.int32), mask.astype(np.uint8)))
            if not dc.dtype:
                dc.dtype, dc.hidden_size = str(states.dtype).removeprefix("torch."), int(states.shape[-1])
        journal.close()
        formats.fold_checksums(states_dir, set(range(n)))
        formats.write_sample_lengths(states_dir, lengths)
        samples = _samples(rows)
        freq_path = data / formats.TOKEN_FREQ
        freq = (
            formats.read_token_freq(freq_path)
            if freq_path.is_file()
            else token_frequencies(samples.tokens, samples.loss_mask)
        )
        if meta is None:
            target = read_model_dir(model)
            longest = int(samples.lengths().max()) if n else 0
            meta = formats.PreparedMetadata(
                model=dc.model,
                seq_length=longest + 1,
                max_tokens=longest,
                num_samples=n,
                num_tokens=int(samples.offsets[-1]),
                num_loss_tokens=int(samples.loss_mask.sum()),
                target_vocab_size=target.vocab_size,
                draft_vocab_size=draft_vocab,
                source=str(data.resolve()),
                mask_method="speculators-prepare-data",
            )
            dc.seq_length = meta.seq_length
        prep_dir.mkdir()
        formats.write_token_freq(prep_dir / formats.TOKEN_FREQ, freq)
        if record is None or (data / f"d2t-{meta.draft_vocab_size}.npy").is_file():
            d2t, t2d = _vocab_for(
                data, draft_vocab if record is None else meta.draft_vocab_size, freq, meta.target_vocab_size
            )
            formats.write_vocab(prep_dir, d2t, t2d)
        formats.write_prepared(prep_dir, samples, meta)
        dc.prepared = str((out / "prepared").resolve())
        formats.write_data_config(states_dir, dc)
    log(f"imported {n} samples -> {out}/prepared, {out}/hidden_states")
    return dc


def _samples(rows: list[tuple[np.ndarray, np.ndarray]]) -> formats.PreparedSamples:
    lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([ids for ids, _ in rows]) if rows else np.zeros(0, np.int32)
    mask = np.concatenate([m for _, m in rows]) if rows else np.zeros(0, np.uint8)
    return formats.PreparedSamples(tokens.astype(np.int32), mask.astype(np.uint8), offsets)


# ---------------------------------------------------------------- command line


@click.command("export-speculators")
@click.option(
    "--prepared",
    type=LoopCheckedPath(),
    required=True,
    help="Our prepared dir (`pipeline prepare`).",
)
@click.option(
    "--data",
    type=LoopCheckedPath(),
    required=True,
    help="Our hidden-states dir (`pipeline extract`).",
)
@click.option(
    "--out",
    type=LoopCheckedPath(),
    required=True,
    help="The dir to pass as `speculators train --data-path`.",
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out.")
def export_command(prepared: Path, data: Path, out: Path, overwrite: bool) -> None:
    """Write what `speculators train` reads (Arrow dataset + hidden_states/hs_{i}.safetensors) from our
    set."""
    export_speculators(prepared, data, out, overwrite=overwrite, log=click.echo)


@click.command("import-speculators")
@click.option("--data", type=LoopCheckedPath(), required=True, help="A `speculators train --data-path` dir.")
@click.option(
    "--out", type=LoopCheckedPath(), required=True, help="Writes OUT/prepared and OUT/hidden_states."
)
@click.option(
    "--model",
    type=LoopCheckedPath(),
    default=None,
    help="The target (needed unless the set was exported here).",
)
@click.option(
    "--layer-ids",
    default=None,
    help="vLLM's layer ids the set was extracted with, final included, e.g. 3,5,6,8.",
)
@click.option(
    "--draft-vocab-size",
    type=int,
    default=None,
    help="Draft vocab (default: the set's d2t-N.npy, else full).",
)
@click.option("--hidden-states", type=LoopCheckedPath(), default=None, help="Default: DATA/hidden_states.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out.")
def import_command(
    data: Path,
    out: Path,
    model: Path | None,
    layer_ids: str | None,
    draft_vocab_size: int | None,
    hidden_states: Path | None,
    overwrite: bool,
) -> None:
    """Write our prepared + hidden-states dirs (what `pipeline train` reads) from a speculators data dir."""
    import_speculators(
        data,
        out,
        model=model,
        layer_ids=parse_layer_ids(layer_ids),
        draft_vocab=draft_vocab_size,
        hidden_states=hidden_states,
        overwrite=overwrite,
        log=click.echo,
    )
