"""The ``weights`` stage: the verifier's embed_tokens, final norm and lm_head, and nothing else.

Owns locating those three tensors in a safetensors checkpoint (through the shard index, opened lazily
with ``safe_open``: a 1T-parameter checkpoint costs three tensor reads), resolving their names for plain
causal LMs and for wrappers (``language_model.`` prefixes), tied embeddings, and writing
``verifier.safetensors`` (keys below) plus ``verifier.json`` (source names, shapes, dtype, source dir).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.atomic import write_json
from pipeline.errors import StageError
from pipeline.modeldir import check_checkpoint, read_model_dir
from pipeline.outdir import refuse_overlap, staged_dir
from pipeline.readers import read_safetensors, read_shard_tensors, read_weight_map

VERIFIER_FILE = "verifier.safetensors"
VERIFIER_META = "verifier.json"
KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


@dataclass(frozen=True)
class VerifierNames:
    """Checkpoint tensor names of the three verifier tensors."""

    embed_tokens: str
    norm: str
    lm_head: str
    tied: bool


def weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or from a single model.safetensors."""
    return read_weight_map(model_dir)


def resolve_names(names: list[str], tie_word_embeddings: bool) -> VerifierNames:
    """Pick the top-level embed/norm/lm_head names; MTP and vision-tower copies are ignored."""
    top = [n for n in names if ".layers." not in n and "vision" not in n and "mm_projector" not in n]
    embeds = sorted((n for n in top if n.endswith("embed_tokens.weight")), key=lambda n: (len(n), n))
    if not embeds:
        raise StageError("no embed_tokens.weight in the checkpoint outside decoder layers: unsupported model layout")
    embed = embeds[0]
    prefix = embed[: -len("embed_tokens.weight")]
    norm = prefix + "norm.weight"
    if norm not in names:
        raise StageError(f"final norm {norm!r} not found next to {embed!r} in the checkpoint")
    heads = sorted((n for n in top if n.endswith("lm_head.weight")), key=lambda n: (len(n), n))
    if heads:
        return VerifierNames(embed, norm, heads[0], tied=False)
    if tie_word_embeddings:
        return VerifierNames(embed, norm, embed, tied=True)
    raise StageError("no lm_head.weight in the checkpoint and tie_word_embeddings is false: cannot build the verifier")


def check_tied(tie_word_embeddings: bool, names: VerifierNames, src: dict) -> None:
    """With ``tie_word_embeddings: true`` the target computes logits with its embedding, whatever lm_head the
    checkpoint also holds: a different lm_head would give a verifier that is not the target's."""
    import torch

    embed, head = src[names.embed_tokens], src[names.lm_head]
    if tie_word_embeddings and not names.tied and (embed.shape != head.shape or not torch.equal(embed, head)):
        raise StageError(
            f"config.json says tie_word_embeddings: true, but the checkpoint's {names.lm_head} differs from "
            f"{names.embed_tokens}: the target computes with the embedding; fix tie_word_embeddings or the checkpoint"
        )


def read_tensors(model_dir: Path, wmap: dict[str, str], names: list[str]) -> dict:
    return read_shard_tensors(model_dir, wmap, names)


def run(model_dir: Path, out: Path, overwrite: bool = False) -> dict:
    refuse_overlap(out, {"--model": model_dir})
    model = read_model_dir(model_dir)
    wmap = weight_map(model_dir)
    check_checkpoint(model, list(wmap))
    names = resolve_names(sorted(wmap), model.tie_word_embeddings)
    src = read_tensors(model_dir, wmap, sorted({names.embed_tokens, names.norm, names.lm_head}))
    check_tied(model.tie_word_embeddings, names, src)
    tensors = {
        "embed_tokens.weight": src[names.embed_tokens].contiguous(),
        "norm.weight": src[names.norm].contiguous(),
        "lm_head.weight": src[names.lm_head].contiguous().clone() if names.tied else src[names.lm_head].contiguous(),
    }
    v, h = model.vocab_size, model.hidden_size
    expected = {"embed_tokens.weight": (v, h), "norm.weight": (h,), "lm_head.weight": (v, h)}
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise StageError(f"{k} has shape {tuple(tensors[k].shape)} in the checkpoint, config.json implies {shape}")
    meta = {
        "source": str(model_dir.resolve()),
        "architecture": model.architecture,
        "names": {"embed_tokens.weight": names.embed_tokens, "norm.weight": names.norm, "lm_head.weight": names.lm_head},
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


def load_verifier(directory: Path) -> dict:
    return read_safetensors(directory / VERIFIER_FILE, "run `pipeline weights --overwrite`")


@click.command("weights")
@click.option("--model", type=click.Path(path_type=Path), required=True, help="Target model dir (safetensors + index).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for verifier.safetensors + verifier.json.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
def command(model: Path, out: Path, overwrite: bool) -> None:
    """Extract the verifier's embed_tokens, final norm and lm_head without loading the model."""
    meta = run(model, out, overwrite)
    names = ", ".join(f"{k} <- {v}" for k, v in meta["names"].items())
    click.echo(f"wrote {out / VERIFIER_FILE} ({names}; tied={meta['tied_word_embeddings']})")
