"""The EAGLE-3 draft model as speculators 0.9.0 defines it: its config, its verifier view, its loading.

Owns how a draft is described and instantiated with speculators' ``Eagle3DraftModel``:

* ``draft_layer_config``: the draft decoder's ``LlamaConfig``, derived from the target's text config
  (vLLM serves EAGLE-3 drafts as Llama layers, ``Eagle3LlamaForCausalLM``, whatever the target is);
* ``build_speculator_config``: the ``Eagle3SpeculatorConfig`` whose ``eagle_aux_hidden_state_layer_ids``
  are in vLLM's convention (id k = input of decoder layer k = output of captured layer k-1);
* ``write_verifier_view``: the directory speculators reads the verifier's embed_tokens / final norm /
  lm_head from (a ``config.json`` plus a ``model.safetensors`` with the key names its suffix match
  expects), made from the ``weights`` stage output;
* the attention kernel choice: speculators' flex attention on GPUs; on the CPU, where flex attention is
  has no backward pass, transformers' SDPA on the dense rendering of the same mask
  (speculators 0.9 builds that mask itself for any implementation other than flex);
* ``new_draft`` / ``load_draft``: a fresh draft with its vocab mapping and verifier tensors, and a saved
  one through speculators' ``from_pretrained``. When the draft vocab equals the target vocab speculators
  keeps no ``d2t``/``t2d`` (vLLM refuses a ``d2t`` then: it has no ``draft_id_to_target_id``).

It does not train (pipeline/train/stage.py) or measure (pipeline/train/evaluate.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.ondisk.atomic import atomic_path, write_json
from pipeline.errors import StageError

FLEX_ATTENTION = "simple_flex_attention"  # registered by speculators.models.eagle3.attention
DENSE_ATTENTION = "sdpa"  # transformers' SDPA on speculators' dense mask
VIEW_CONFIG = "config.json"
VIEW_WEIGHTS = "model.safetensors"
# the key names speculators' load_model_layers() finds by suffix
VIEW_KEYS = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# the config fields TargetFacts reads
CONFIG_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


@dataclass(frozen=True)
class TargetFacts:
    """What the draft needs to know about the target model, from its (text) config."""

    model_type: str
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    rope_parameters: dict  # transformers 5's form: rope_type, rope_theta and the scaling keys
    max_position_embeddings: int
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | list | None

    @classmethod
    def from_config_dict(cls, raw: dict) -> TargetFacts:
        text = raw.get("text_config") or raw
        model_type = str(text.get("model_type", raw.get("model_type", "")))
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        # MLA models (DeepSeek/Kimi) have no plain head_dim: the draft uses hidden // heads, as speculators
        # does
        head_dim = (
            int(text.get("head_dim") or hidden // heads) if model_type in LLAMA_FAMILY else hidden // heads
        )
        return cls(
            model_type=model_type,
            architectures=tuple(raw.get("architectures") or ()),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            vocab_size=int(text["vocab_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
            hidden_act=str(text.get("hidden_act") or "silu"),
            rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
            rope_parameters=_rope_parameters(text, model_type),
            max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_id=text.get("eos_token_id", raw.get("eos_token_id")),
        )


def _rope_parameters(text: dict, model_type: str) -> dict:
    """The target's rope as transformers 5 spells it (``rope_parameters``), also from a 4.x config.

    Scaling is kept for the Llama family only: an MLA target's yarn scaling belongs to its rope head
    dimension, not to the draft's plain heads.
    """
    given = text.get("rope_parameters")
    if isinstance(given, dict) and "sliding_attention" not in given and "full_attention" not in given:
        theta = given.get("rope_theta", text.get("rope_theta"))
        scaling = {k: v for k, v in given.items() if k != "rope_theta"}
    else:
        theta = text.get("rope_theta")
        scaling = dict(text.get("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
    if (
        model_type not in LLAMA_FAMILY
        or not scaling.get("rope_type")
        or scaling.get("rope_type") == "default"
    ):
        scaling = {"rope_type": "default"}
    return {**scaling, "rope_theta": float(theta or 10000.0)}


def _resolved_config(model_dir: Path) -> dict:
    """The target's config as its own (remote) code resolves it: defaults and attribute aliases applied."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own code is the same operator problem
        raise StageError(
            f"{model_dir}/config.json does not load with its own code ({type(exc).__name__}: {exc}): "
            "fix the model dir or drop --trust-remote-code (then config.json is read as plain JSON)"
        ) from None

    def flat(cfg) -> dict:  # to_dict() leaves aliased names (attribute_map) out; getattr resolves them
        out = cfg.to_dict()
        out.update({k: getattr(cfg, k) for k in CONFIG_KEYS if getattr(cfg, k, None) is not None})
        return out

    resolved = flat(config)
    text = getattr(config, "text_config", None)
    if text is not None and not isinstance(text, dict):
        resolved["text_config"] = flat(text)
    return resolved


def read_target_facts(model_dir: Path, trust_remote_code: bool = False) -> TargetFacts:
    """The target's facts from its config.json: as plain JSON, or through its own config code if trusted."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise StageError(
            f"{path} not found: pass --model with the target model dir (its config.json is read)"
        )
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise StageError(f"{path} is not JSON ({exc}): fix or replace the target's config.json") from None
    if trust_remote_code:
        raw = {**raw, **_resolved_config(Path(model_dir))}
    try:
        return TargetFacts.from_config_dict(raw)
    except (KeyError, ValueError, TypeError) as exc:
        raise StageError(f"{path} lacks what the draft needs ({exc}): not a decoder-only LM config") from None


# ---------------------------------------------------------------- configs


def draft_layer_config(target: TargetFacts, num_layers: int = 1, intermediate_size: int | None = None):
    """The draft decoder's LlamaConfig: the target's width and attention shape, ``num_layers`` layers."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        hidden_act=target.hidden_act,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_parameters=dict(target.rope_parameters),
        tie_word_embeddings=False,
        pad_token_id=target.pad_token_id,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
    )
    return cfg


def build_speculator_config(
    *,
    target: TargetFacts,
    verifier_view: Path,
    draft_vocab_size: int,
    vllm_aux_layer_ids: list[int],
    ttt_steps: int,
    num_layers: int = 1,
    norm_before_residual: bool = False,
    intermediate_size: int | None = None,
):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return Eagle3SpeculatorConfig(
        tie_word_embeddings=False,  # HF would otherwise tie the draft-vocab lm_head to the full embedding
        transformer_layer_config=draft_layer_config(target, num_layers, intermediate_size),
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=list(vllm_aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=str(Path(verifier_view).resolve()), architectures=list(target.architectures)
            ),
        ),
    )


# ---------------------------------------------------------------- verifier view


def write_verifier_view(view: Path, verifier: dict[str, torch.Tensor], target: TargetFacts) -> Path:
    """Write the directory speculators loads the verifier tensors from; return it."""
    from safetensors.torch import save_file

    view.mkdir(parents=True, exist_ok=True)
    tensors = {VIEW_KEYS[k]: verifier[k].contiguous() for k in VIEW_KEYS}
    with atomic_path(view / VIEW_WEIGHTS) as tmp:
        save_file(tensors, str(tmp))
    config = {
        # only read for vocab/hidden size, norm eps and pad id; llama needs no remote code
        "model_type": "llama",
        "architectures": list(target.architectures) or ["LlamaForCausalLM"],
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": target.num_layers,
        "rms_norm_eps": target.rms_norm_eps,
        "pad_token_id": target.pad_token_id,
        "tie_word_embeddings": False,
    }
    write_json(view / VIEW_CONFIG, config)
    return view


# ---------------------------------------------------------------- attention


def choose_attention(device: torch.device, requested: str = "auto") -> str:
    """``flex`` (speculators' kernel; GPUs), ``dense`` (SDPA on the dense mask; any device) or ``auto``."""
    if requested == "auto":
        return FLEX_ATTENTION if device.type == "cuda" else DENSE_ATTENTION
    if requested == "flex":
        if device.type == "cpu":
            raise StageError(
                "--attention flex has no backward pass on the CPU "
                "(torch: FlexAttention does not support backward on CPU): use --attention dense or auto"
            )
        return FLEX_ATTENTION
    if requested == "dense":
        return DENSE_ATTENTION
    raise StageError(f"unknown --attention {requested!r}: choose auto, flex or dense")


def set_attention(config, implementation: str) -> None:
    """Choose the kernel of a draft built from ``config`` afterwards (speculators picks its mask at init)."""
    import speculators.models.eagle3.attention  # noqa: F401 - registers the flex kernel

    config.transformer_layer_config._attn_implementation = implementation


# ---------------------------------------------------------------- model


def new_draft(config, d2t: np.ndarray, t2d: np.ndarray):
    """A freshly initialised speculators Eagle3DraftModel with its vocab mapping and verifier tensors."""
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel(config=config)
    model.load_vocab_mappings(
        torch.from_numpy(np.asarray(t2d, dtype=bool)), torch.from_numpy(np.asarray(d2t, dtype=np.int64))
    )
    model.load_verifier_weights()
    return model


def read_checkpoint_vocab(path: Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d2t, t2d) of a saved draft; (None, None) for a full-vocab draft, which stores neither."""
    from safetensors import safe_open

    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        raise StageError(f"{weights} not found: {path} is not a draft checkpoint (run `pipeline train`)")
    with safe_open(str(weights), framework="pt") as fh:
        keys = set(fh.keys())  # noqa: SIM118
        if {"d2t", "t2d"} <= keys:
            return fh.get_tensor("d2t"), fh.get_tensor("t2d")
    return None, None


def load_draft(path: Path, *, attention: str | None = None, verifier_view: Path | None = None):
    """Load a saved draft with speculators' config loader and ``from_pretrained``.

    The verifier tensors come from ``verifier_view``, else from a train output's ``verifier/`` beside the
    checkpoint (``OUT/draft`` or ``OUT/checkpoints/N``), else from the path recorded in config.json.
    """
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    path = Path(path)
    config = Eagle3SpeculatorConfig.from_pretrained(str(path))
    if verifier_view is None:
        verifier_view = next(
            (
                d / "verifier"
                for d in (path.parent, path.parent.parent)
                if (d / "verifier" / VIEW_CONFIG).is_file()
            ),
            None,
        )
    if verifier_view is not None:
        config.speculators_config.verifier.name_or_path = str(Path(verifier_view).resolve())
    view = Path(config.speculators_config.verifier.name_or_path or "")
    if not (view / VIEW_CONFIG).is_file():
        raise StageError(
            f"verifier {view} recorded in {path}/config.json does not exist here: "
            "pass the train output's verifier/ dir"
        )
    set_attention(config, attention or DENSE_ATTENTION)
    d2t, t2d = read_checkpoint_vocab(path)
    model = Eagle3DraftModel.from_pretrained(str(path), config=config, t2d=t2d, d2t=d2t, dtype=torch.float32)
    model.eval()
    return model
