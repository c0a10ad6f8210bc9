"""The ``weights`` stage: the verifier's embed_tokens, final norm and lm_head, and nothing else.

Owns locating those three tensors in a safetensors checkpoint (through the shard index, opened lazily with
``safe_open``: a 1T-parameter checkpoint costs three tensor reads) by the names pipeline/model/modeldir.py
resolves for plain causal LMs, wrappers (``language_model.`` prefixes) and tied embeddings, and writing
``verifier.safetensors`` (keys below) plus ``verifier.json`` (source names, shapes, dtype, source dir).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.ondisk.atomic import write_json
from pipeline.errors import StageError
from pipeline.model.modeldir import check_checkpoint, read_model_dir, resolve_names
from pipeline.options import opt, options, validate
from pipeline.ondisk.outdir import refuse_overlap, staged_dir
from pipeline.ondisk.formats import VERIFIER_FILE, VERIFIER_META
from pipeline.ondisk.readers import read_shard_tensors, read_weight_map


@dataclass(frozen=True)
class WeightsConfig:
    """Options of the weights stage (the command line is made from these fields: pipeline/options.py)."""

    model: Path = opt(help="Target model dir (safetensors + index).")
    out: Path = opt(help="Directory for verifier.safetensors + verifier.json.")
    overwrite: bool = opt(False, help="Replace an existing output directory.")

    def __post_init__(self) -> None:
        validate(self)  # a path with a symlink loop on it, as every stage's config refuses


def weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or from a single model.safetensors."""
    return read_weight_map(model_dir)


def read_tensors(model_dir: Path, wmap: dict[str, str], names: list[str]) -> dict:
    return read_shard_tensors(model_dir, wmap, names)


def run(model_dir: Path, out: Path, overwrite: bool = False) -> dict:
    refuse_overlap(out, {"--model": model_dir})
    model = read_model_dir(model_dir)
    wmap = weight_map(model_dir)
    check_checkpoint(model, wmap)  # layers, and a tied config's lm_head
    names = resolve_names(sorted(wmap), model.tie_word_embeddings)
    src = read_tensors(model_dir, wmap, sorted({names.embed_tokens, names.norm, names.lm_head}))
    tensors = {
        "embed_tokens.weight": src[names.embed_tokens].contiguous(),
        "norm.weight": src[names.norm].contiguous(),
        "lm_head.weight": src[names.lm_head].contiguous().clone()
        if names.tied
        else src[names.lm_head].contiguous(),
    }
    v, h = model.vocab_size, model.hidden_size
    expected = {"embed_tokens.weight": (v, h), "norm.weight": (h,), "lm_head.weight": (v, h)}
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise StageError(
                f"{k} has shape {tuple(tensors[k].shape)} in the checkpoint, config.json implies {shape}"
            )
    meta = {
        "source": str(model_dir.resolve()),
        "architecture": model.architecture,
        "names": {
            "embed_tokens.weight": names.embed_tokens,
            "norm.weight": names.norm,
            "lm_head.weight": names.lm_head,
        },
        "tied_word_embeddings": names.tied,
        "shapes": {k: list(t.shape) for k, t in tensors.items()},
        "dtype": str(tensors["lm_head.weight"].dtype).removeprefix("torch."),
        "hidden_size": h,
        "vocab_size": v,
    }
    from safetensors.torch import save_file

    with staged_dir(out, overwrite=overwrite, inputs={"--model": model_dir}) as staging:
        save_file(tensors, str(staging / VERIFIER_FILE), metadata={"source": meta["source"]})
        write_json(staging / VERIFIER_META, meta)
    return meta


@click.command("weights")
@options(WeightsConfig)
def command(**kwargs) -> None:
    """Extract the verifier's embed_tokens, final norm and lm_head without loading the model."""
    cfg = WeightsConfig(**kwargs)
    meta = run(cfg.model, cfg.out, cfg.overwrite)
    names = ", ".join(f"{k} <- {v}" for k, v in meta["names"].items())
    click.echo(f"wrote {cfg.out / VERIFIER_FILE} ({names}; tied={meta['tied_word_embeddings']})")
