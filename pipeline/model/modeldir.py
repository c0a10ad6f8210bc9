"""A local model directory: its config, text config and shape facts, read without loading weights.

Owns the resolution of wrapper models (vision-language wrappers such as Kimi-K2.5 keep the decoder's
config under ``text_config``) and the checks that a directory is a usable target model, its config
consistent with its checkpoint (every layer claimed has weights; none is left unused; a tied config has no
different lm_head), and the names of the tensors the verifier is made of (embed_tokens, final norm, lm_head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StageError
from pipeline.ondisk.readers import INDEX, read_model_config, read_shard_tensors, read_weight_map


@dataclass(frozen=True)
class ModelDir:
    """Shape facts of a target model, from config.json alone."""

    path: Path
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    is_wrapper: bool
    torch_dtype: str | None
    raw: dict

    @property
    def name(self) -> str:
        return self.path.name


def read_model_dir(path: Path | str) -> ModelDir:
    """Read ``config.json`` of a model directory; raise a one-line StageError if it is not usable."""
    path = Path(path)
    if not path.is_dir():
        raise StageError(
            f"model dir {path} does not exist (pass --model DIR with config.json, tokenizer and safetensors)"
        )
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise StageError(
            f"{path} has no config.json: not a model directory (pass the directory saved by save_pretrained)"
        )
    raw = read_model_config(cfg_path)
    text = raw.get("text_config") or raw
    archs = raw.get("architectures") or []
    return ModelDir(
        path=path,
        architecture=archs[0] if archs else "",
        model_type=str(text.get("model_type", raw.get("model_type", ""))),
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        is_wrapper="text_config" in raw,
        torch_dtype=text.get("torch_dtype") or raw.get("torch_dtype") or text.get("dtype"),
        raw=raw,
    )


def decoder_layers_in(names: list[str]) -> tuple[str, set[int]]:
    """The decoder's name prefix (of the embed_tokens with the most numbered layers beside it; ties: the
    shortest name) and the layer numbers that have weights under it; vision towers and other modules'
    layers are not counted (a wrapper's vision tower may have an embed_tokens of its own)."""

    def layers_under(prefix: str) -> set[int]:
        pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
        return {int(m.group(1)) for n in names if (m := pattern.match(n))}

    prefixes = [
        n[: -len("embed_tokens.weight")]
        for n in names
        if n.endswith("embed_tokens.weight") and ".layers." not in n
    ]
    if not prefixes:
        return "", layers_under("")
    found = {p: layers_under(p) for p in prefixes}
    prefix = min(found, key=lambda p: (-len(found[p]), len(p), p))
    return prefix, found[prefix]


@dataclass(frozen=True)
class VerifierNames:
    """Checkpoint tensor names of the three verifier tensors."""

    embed_tokens: str
    norm: str
    lm_head: str
    tied: bool


def _embed_and_head(names: list[str]) -> tuple[str | None, str | None]:
    """The top-level embed_tokens and lm_head names (MTP and vision-tower copies ignored), None where
    absent."""
    top = [n for n in names if ".layers." not in n and "vision" not in n and "mm_projector" not in n]

    def first(suffix: str) -> str | None:
        return min((n for n in top if n.endswith(suffix)), key=lambda n: (len(n), n), default=None)

    return first("embed_tokens.weight"), first("lm_head.weight")


def resolve_names(names: list[str], tie_word_embeddings: bool) -> VerifierNames:
    """Pick the top-level embed/norm/lm_head names; MTP and vision-tower copies are ignored."""
    embed, head = _embed_and_head(names)
    if embed is None:
        raise StageError(
            "no embed_tokens.weight in the checkpoint outside decoder layers: unsupported model layout"
        )
    prefix = embed[: -len("embed_tokens.weight")]
    norm = prefix + "norm.weight"
    if norm not in names:
        raise StageError(f"final norm {norm!r} not found next to {embed!r} in the checkpoint")
    if head is not None:
        return VerifierNames(embed, norm, head, tied=False)
    if tie_word_embeddings:
        return VerifierNames(embed, norm, embed, tied=True)
    raise StageError(
        "no lm_head.weight in the checkpoint and tie_word_embeddings is false: cannot build the verifier"
    )


def check_tied(embed_name: str, head_name: str, src: dict) -> None:
    """With ``tie_word_embeddings: true`` the target computes logits with its embedding, whatever lm_head
    the checkpoint also holds: a different lm_head would give a verifier (and states) that are not the
    target's."""
    import torch

    embed, head = src[embed_name], src[head_name]
    if embed.shape != head.shape or not torch.equal(embed, head):
        raise StageError(
            f"config.json says tie_word_embeddings: true, but the checkpoint's {head_name} differs from "
            f"{embed_name}: the target computes with the embedding; fix tie_word_embeddings or the checkpoint"
        )


def check_checkpoint(model: ModelDir, wmap: dict[str, str] | None = None) -> None:
    """Config vs checkpoint, before any model runs: every decoder layer config.json claims has weights, no
    decoder layer's weights would be left unused (multi-token-prediction layers that the config declares
    with ``num_nextn_predict_layers`` aside), and a config that ties the embeddings has no lm_head that
    differs from them. A mismatch would run randomly initialised layers, a different model than the
    checkpoint holds, or a head the target never computes with. ``wmap`` (tensor name -> shard) defaults to
    the safetensors checkpoint's index or header; tensors are read only for a tied config whose checkpoint
    also holds an lm_head (the two are compared whole); a directory without safetensors is not checked."""
    if wmap is None:
        if not ((model.path / INDEX).is_file() or (model.path / "model.safetensors").is_file()):
            return
        wmap = read_weight_map(model.path)
    check_layers(model, list(wmap))
    check_tied_head(model, wmap)


def check_tied_head(model: ModelDir, wmap: dict[str, str]) -> None:
    """A config that ties the embeddings has no lm_head that differs from them (both read, only then)."""
    embed, head = _embed_and_head(list(wmap))
    if model.tie_word_embeddings and embed is not None and head is not None:
        check_tied(embed, head, read_shard_tensors(model.path, wmap, [embed, head]))


def check_layers(model: ModelDir, names: list[str]) -> None:
    """Every decoder layer config.json claims has weights; none is left unused (declared MTP layers aside)."""
    prefix, present = decoder_layers_in(names)
    text = model.raw.get("text_config") or model.raw
    mtp = text.get("num_nextn_predict_layers") or 0
    mtp = mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0 else 0
    claimed = set(range(model.num_layers))
    missing = sorted(claimed - present)
    if missing:
        raise StageError(
            f"{model.path / 'config.json'} claims {model.num_layers} decoder layers "
            "but the checkpoint has no "
            f"weights for {_span(missing)} "
            f"({len(present)} layers under {prefix or '(top level)'}layers.): fix "
            "num_hidden_layers, or complete the checkpoint"
        )
    unused = sorted(present - claimed - set(range(model.num_layers, model.num_layers + mtp)))
    if unused:
        raise StageError(
            f"the checkpoint in {model.path} has weights for {_span(unused)} that config.json's "
            f"num_hidden_layers = {model.num_layers} leaves unused: fix num_hidden_layers (or declare "
            "multi-token-prediction layers with num_nextn_predict_layers)"
        )


def _span(layers: list[int]) -> str:
    shown = ", ".join(map(str, layers[:6])) + (", ..." if len(layers) > 6 else "")
    return f"layer{'s' if len(layers) > 1 else ''} {shown}"
