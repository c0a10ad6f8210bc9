"""A local model directory: its config, text config and shape facts, read without loading weights.

Owns the resolution of wrapper models (vision-language wrappers such as Kimi-K2.5 keep the decoder's
config under ``text_config``) and the checks that a directory is a usable target model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StageError
from pipeline.readers import read_model_config


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
        raise StageError(f"model dir {path} does not exist (pass --model DIR with config.json, tokenizer and safetensors)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise StageError(f"{path} has no config.json: not a model directory (pass the directory saved by save_pretrained)")
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
