"""The train stage's inputs, read and cross-checked before the first step: an offline run's hidden-states set
(``check_inputs``) or a produced run's plan (``produced_inputs``: the prepared set and the target as extract
checks them, the states dir's description as extract would write it, the producer's options), each joined to
the target, the verifier and the vocab mapping (``target_inputs``), and the train/held-out split
(``split_indices``). Every refusal is one StageError line naming the input and what to run; nothing here
writes. pipeline/train/stage.py runs the stage on what this returns.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import StageError
from pipeline.model.layers import NUM_CAPTURED, to_vllm_aux_ids, validate_layer_ids
from pipeline.model.vocab import vocab_mapping_problems
from pipeline.ondisk import formats
from pipeline.train import produced as produced_mod
from pipeline.train.config import TrainConfig
from pipeline.train.draft import TargetFacts, read_target_facts
from pipeline.train.produced import Produced


@dataclass
class TrainInputs:
    """Everything checked before training starts."""

    files: list[Path]
    train_files: list[Path]
    eval_files: list[Path]
    data_config: formats.DataConfig
    layer_ids: list[int]
    vllm_aux_layer_ids: list[int]
    target: TargetFacts
    model_dir: Path
    verifier: dict[str, torch.Tensor]
    d2t: np.ndarray
    t2d: np.ndarray
    token_freq: dict[int, int] = field(default_factory=dict)
    train_tokens: int = 0


def resolve_prepared(cfg: TrainConfig, dc: formats.DataConfig) -> Path:
    if cfg.prepared is not None:
        return Path(cfg.prepared)
    if dc.prepared and Path(dc.prepared).is_dir():
        return Path(dc.prepared)
    raise StageError(
        f"{cfg.data}/data_config.json names prepared dir {dc.prepared!r}, which does not exist: "
        "pass --prepared DIR (with d2t.npy, t2d.npy)"
    )


def _resolve_model(cfg: TrainConfig, meta: dict, dc: formats.DataConfig) -> Path:
    candidates = [cfg.model, meta.get("source"), dc.model]
    for c in candidates:
        if c and (Path(c) / "config.json").is_file():
            return Path(c)
    raise StageError(
        "no target config.json found "
        f"(tried --model, verifier.json source {meta.get('source')!r}, data_config model {dc.model!r}): "
        "pass --model DIR"
    )


def _read_verifier(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = formats.load_verifier(Path(directory))
    missing = [k for k in formats.VERIFIER_KEYS if k not in tensors]
    if missing:
        raise StageError(
            f"{directory}/verifier.safetensors lacks {', '.join(missing)}: re-run `pipeline weights`"
        )
    meta_path = Path(directory) / formats.VERIFIER_META
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return tensors, meta


def split_indices(
    n: int, eval_fraction: float, seed: int, min_eval: int = 1, held_out: str = "shuffled"
) -> tuple[list[int], list[int]]:
    """0..n-1 split into (train, held-out), both non-empty: a seeded shuffle's share held out, or with
    ``held_out="last"`` the last samples, at the boundary speculators' ArrowDataset draws for the rows
    export-speculators writes in sample order (``int(n * train_ratio)``, train_ratio = 1 - eval_fraction)."""
    if n < 2:
        raise StageError(
            f"{n} sample(s) in the hidden-states dir: at least 2 are needed (one to train on, one held out)"
        )
    if not 0.0 < eval_fraction < 1.0:
        raise StageError(f"--eval-fraction {eval_fraction} must be between 0 and 1 (exclusive)")
    if held_out == "last":
        boundary = min(n - min_eval, max(1, int(n * (1.0 - eval_fraction))))
        return list(range(boundary)), list(range(boundary, n))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = min(n - 1, max(min_eval, round(n * eval_fraction)))
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def _check_sample(path: Path, dc: formats.DataConfig, vocab: int) -> None:
    try:
        sample = formats.read_sample(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same operator problem
        raise StageError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}): re-run `pipeline extract`"
        ) from None
    missing = [k for k in formats.DATA_KEYS if k not in sample]
    if missing:
        raise StageError(f"{path} lacks {', '.join(missing)}: not a hidden-states sample")
    hs = sample["hidden_states"]
    if not isinstance(hs, (list, tuple)) or len(hs) != NUM_CAPTURED:
        got = len(hs) if isinstance(hs, (list, tuple)) else type(hs).__name__
        raise StageError(
            f"{path} has {got} captured hidden-state tensors, EAGLE-3 needs {NUM_CAPTURED} "
            "(3 auxiliary layers + the last): "
            "re-run `pipeline extract` with 4 --layer-ids"
        )
    t = int(sample["input_ids"].shape[0])
    for j, h in enumerate(hs):
        if tuple(h.shape) != (t, dc.hidden_size):
            raise StageError(
                f"{path}: hidden_states[{j}] has shape {tuple(h.shape)}, expected ({t}, {dc.hidden_size}) "
                "(hidden size from data_config.json)"
            )
    if t < 2:
        raise StageError(f"{path} has {t} token(s): at least 2 are needed")
    if int(sample["input_ids"].max()) >= vocab or int(sample["input_ids"].min()) < 0:
        raise StageError(
            f"{path}: token ids outside the target vocab of {vocab}: hidden states and model disagree"
        )


def check_inputs(cfg: TrainConfig) -> TrainInputs:
    """Read and cross-check every input; raise a one-line StageError before any training step."""
    data = Path(cfg.data)
    dc = formats.read_data_config(data)
    indices = formats.existing_data_indices(data)
    if not indices:
        raise StageError(f"{data} has no data_*.pt files: run `pipeline extract` first")
    if indices != list(range(len(indices))):
        gaps = sorted(set(range(indices[-1] + 1)) - set(indices))[:5]
        raise StageError(
            f"{data}: data files are not numbered 0..N-1 (missing e.g. {gaps}): resume `pipeline extract`"
        )
    if len(indices) != dc.num_samples:
        raise StageError(
            f"{data} holds {len(indices)} data files but data_config.json says {dc.num_samples}: "
            "extraction incomplete, resume `pipeline extract`"
        )
    if len(dc.layer_ids) != NUM_CAPTURED:
        raise StageError(
            f"{data}/data_config.json lists {len(dc.layer_ids)} layer ids {dc.layer_ids}, "
            f"EAGLE-3 needs {NUM_CAPTURED} "
            "(3 auxiliary layers + the last): re-run `pipeline extract`"
        )
    layer_ids = validate_layer_ids(dc.layer_ids, dc.num_layers)
    verifier, meta = _read_verifier(Path(cfg.verifier))
    model_dir = _resolve_model(cfg, meta, dc)
    inputs = target_inputs(cfg, dc, layer_ids, model_dir, verifier, resolve_prepared(cfg, dc))
    for path in {inputs.files[0], inputs.files[-1]}:
        _check_sample(path, dc, inputs.target.vocab_size)
    return inputs


def target_inputs(
    cfg: TrainConfig,
    dc: formats.DataConfig,
    layer_ids: list[int],
    model_dir: Path,
    verifier: dict[str, torch.Tensor],
    prepared: Path,
    lengths: dict[int, int] | None = None,
) -> TrainInputs:
    """The checks that join a states set's description (``dc``: found on disk offline, planned online) to
    the target, the verifier and the vocab mapping; the split of its ``dc.num_samples`` samples."""
    data = Path(cfg.data)
    target = read_target_facts(model_dir, cfg.trust_remote_code)
    emb, norm, head = verifier["embed_tokens.weight"], verifier["norm.weight"], verifier["lm_head.weight"]
    sizes = {
        "data_config.json": dc.hidden_size,
        "target config.json": target.hidden_size,
        "verifier embed_tokens": int(emb.shape[-1]),
        "verifier lm_head": int(head.shape[-1]),
        "verifier norm": int(norm.shape[0]),
    }
    if len(set(sizes.values())) != 1:
        raise StageError(
            "hidden size mismatch: "
            + ", ".join(f"{k} {v}" for k, v in sizes.items())
            + ": hidden states, verifier and target must come from the same model"
        )
    if dc.num_layers != target.num_layers:
        raise StageError(
            f"data_config.json says {dc.num_layers} decoder layers, the target config {target.num_layers}: "
            "hidden states come from another model"
        )
    vocab = {
        "target config.json": target.vocab_size,
        "verifier embed_tokens": int(emb.shape[0]),
        "verifier lm_head": int(head.shape[0]),
    }
    if len(set(vocab.values())) != 1:
        raise StageError(
            "target vocab mismatch: "
            + ", ".join(f"{k} {v}" for k, v in vocab.items())
            + ": re-run `pipeline weights` for this target"
        )

    d2t, t2d = formats.read_vocab(prepared)
    expected_draft = cfg.draft_vocab_size if cfg.draft_vocab_size is not None else len(d2t)
    problems = vocab_mapping_problems(d2t, t2d, expected_draft, target.vocab_size)
    if problems:
        raise StageError(
            f"vocab mapping in {prepared} does not fit this draft: {'; '.join(problems)} "
            "(re-run `pipeline prepare --draft-vocab-size N`)"
        )
    freq_path = prepared / formats.TOKEN_FREQ
    token_freq = formats.read_token_freq(freq_path) if freq_path.is_file() else {}

    files = [formats.data_file(data, i) for i in range(dc.num_samples)]
    train_idx, eval_idx = split_indices(len(files), cfg.eval_fraction, cfg.seed, held_out=cfg.held_out)
    lengths = formats.read_sample_lengths(data) if lengths is None else lengths
    train_tokens = sum(min(lengths.get(i, 0), cfg.max_len + 1) - 1 for i in train_idx) if lengths else 0
    return TrainInputs(
        files=files,
        train_files=[files[i] for i in train_idx],
        eval_files=[files[i] for i in eval_idx],
        data_config=dc,
        layer_ids=layer_ids,
        vllm_aux_layer_ids=to_vllm_aux_ids(layer_ids),
        target=target,
        model_dir=Path(model_dir).resolve(),
        verifier=verifier,
        d2t=np.asarray(d2t, dtype=np.int64),
        t2d=np.asarray(t2d, dtype=bool),
        token_freq=token_freq,
        train_tokens=train_tokens,
    )


def produced_inputs(cfg: TrainConfig, world_size: int = 1) -> tuple[TrainInputs, Produced]:
    """The inputs of a run that produces its states: the prepared set and the target as extract checks
    them, the states dir's description as extract would write it (plus the plan), then the same checks
    against the verifier and the vocab mapping as an offline run's. ``world_size`` > 1 (torchrun): a vllm
    producer runs in a process of its own, on the GPUs after the trainers'."""
    from pipeline.backends.base import BackendOptions, resolve_device, resolve_dtype
    from pipeline.backends.choice import resolve
    from pipeline.model.modeldir import check_checkpoint, read_model_dir
    from pipeline.ondisk import provenance
    from pipeline.train import states

    prepared, meta = formats.read_prepared(Path(cfg.prepared))
    model = read_model_dir(cfg.model)
    check_checkpoint(model)
    if meta.target_vocab_size != model.vocab_size:
        raise StageError(
            f"{cfg.prepared} was prepared for a vocab of {meta.target_vocab_size}, "
            f"but {cfg.model} has {model.vocab_size}: re-run prepare with this model"
        )
    layer_ids = validate_layer_ids(cfg.layer_ids, model.num_layers)
    choice = resolve(cfg.states_backend, model.path)  # extract's rule for --backend auto
    hf = choice.backend == "hf"
    engine = produced_mod.engine_placement(cfg, choice.backend, world_size)
    # one process's engine process takes the GPUs (and the share) its thread would
    share = produced_mod.memory_share(cfg, choice.backend, model.path, engine if world_size > 1 else None)
    dtype = resolve_dtype(  # as extract: the vllm engine's auto is bf16 wherever it runs
        cfg.states_dtype if hf or cfg.states_dtype != "auto" else "bfloat16",
        resolve_device(cfg.states_device) if hf else torch.device("cpu"),
    )
    n = len(prepared)
    train, held_out = split_indices(n, cfg.eval_fraction, cfg.seed, held_out=cfg.held_out)
    lengths = [prepared.length(i) for i in range(n)]
    width = torch.empty((), dtype=dtype).element_size()
    # what one sample may hold on disk: its file, and with vllm, before it, the engine's file of it
    sizes = [states.disk_bytes(t, model.hidden_size, len(layer_ids), width, choice.backend) for t in lengths]
    # the training samples evaluate.py's unigram baseline reads at the end: kept too
    measured = train[: cfg.eval_max_samples] if cfg.evaluate else []
    plan = states.plan_states(
        cfg.states_mode, states.parse_bytes(cfg.states_budget), sizes, train, held_out, measured
    )
    dc = formats.states_config(
        model,
        layer_ids,
        dtype,
        n,
        meta.seq_length,
        Path(cfg.prepared),
        choice.backend,
        provenance.record("train-states"),
        extra={"states": plan.record()},
    )
    verifier, _ = _read_verifier(Path(cfg.verifier))
    inputs = target_inputs(
        cfg, dc, layer_ids, model.path, verifier, Path(cfg.prepared), dict(enumerate(lengths))
    )
    options = BackendOptions(
        model=model,
        layer_ids=tuple(layer_ids),
        device=cfg.states_device,
        dtype=cfg.states_dtype,
        seq_length=meta.seq_length,
        max_batch_tokens=cfg.states_max_batch_tokens,
        trust_remote_code=cfg.trust_remote_code,
        scratch_dir=Path(cfg.data),
        tensor_parallel_size=cfg.states_tensor_parallel_size,
        # at most: every training sample each epoch and the held-out once (vllm's compile decision)
        planned_tokens=cfg.epochs * sum(lengths[i] for i in train) + sum(lengths[i] for i in held_out),
        memory_share=share.value,
    )
    shown = "" if hf else f"; memory share {share.value or 'vLLM default'}: {share.reason}"
    if engine is not None:
        where = "on the CPU"
        if engine.gpus:
            where = f"CUDA_VISIBLE_DEVICES={','.join(engine.gpus)}"
            trainers = "the trainers' GPUs" if world_size > 1 else "the trainer's GPU"
            where += f", {trainers} too" if engine.shared else ", GPUs of its own"
        shown += f"; in a process of its own, {where}"
    return inputs, Produced(
        prepared, dc, plan, sizes, train, held_out, options, choice.backend, choice.reason, shown, engine
    )
