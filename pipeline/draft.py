"""The EAGLE-3 draft model as speculators 0.4.0.1 defines it: its config, its verifier view, its loading.

Owns how a draft is described and instantiated with speculators' ``Eagle3DraftModel``:

* ``draft_layer_config``: the draft decoder's ``LlamaConfig``, derived from the target's text config
  (vLLM 0.16.0 serves EAGLE-3 drafts as Llama layers whatever the target architecture is);
* ``build_speculator_config``: the ``Eagle3SpeculatorConfig`` whose ``eagle_aux_hidden_state_layer_ids``
  are in vLLM's convention (input of layer k+1 = output of captured layer k);
* ``write_verifier_view``: the directory speculators reads the verifier's embed_tokens / final norm /
  lm_head from (a ``config.json`` plus a ``model.safetensors`` with the key names its suffix match
  expects), made from the ``weights`` stage output;
* the attention kernel choice (speculators' flex attention on GPUs; on the CPU, where flex attention
  has no backward, the same mask evaluated densely and fed to SDPA);
* ``load_draft``: loading a saved draft through speculators' ``from_pretrained``, with a shim for two
  defects of 0.4.0.1 (its ``from_pretrained`` forwards a ``verifier`` argument the Eagle-3 constructor
  rejects, and the meta-device init of transformers 4.57 breaks the verifier-weight copy in ``__init__``).

It does not train (pipeline/train.py) or measure (pipeline/evaluate.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.atomic import atomic_path, write_json
from pipeline.errors import StageError

FLEX_ATTENTION = "simple_flex_attention"  # registered by speculators.models.eagle3.attention
DENSE_ATTENTION = "pipeline_dense_sdpa"  # registered below
VIEW_CONFIG = "config.json"
VIEW_WEIGHTS = "model.safetensors"
# the key names speculators' load_model_layers() finds by suffix
VIEW_KEYS = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


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
    rope_theta: float
    rope_scaling: dict | None
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
        # MLA models (DeepSeek/Kimi) have no plain head_dim: the draft uses hidden // heads, as speculators does
        head_dim = int(text.get("head_dim") or hidden // heads) if model_type in LLAMA_FAMILY else hidden // heads
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
            rope_theta=float(text.get("rope_theta") or 10000.0),
            rope_scaling=text.get("rope_scaling") if model_type in LLAMA_FAMILY else None,
            max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_id=text.get("eos_token_id", raw.get("eos_token_id")),
        )


def read_target_facts(model_dir: Path) -> TargetFacts:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise StageError(f"{path} not found: pass --model with the target model dir (its config.json is read)")
    try:
        return TargetFacts.from_config_dict(json.loads(path.read_text()))
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
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
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
            verifier=VerifierConfig(name_or_path=str(Path(verifier_view).resolve()),
                                    architectures=list(target.architectures)),
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
        "model_type": "llama",  # only read for vocab/hidden size, norm eps and pad id; llama needs no remote code
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


def dense_block_mask(block_mask, q_len: int, kv_len: int) -> torch.Tensor:
    """Evaluate a flex-attention BlockMask's mask_mod on the full [q_len, kv_len] grid (bool)."""
    device = block_mask.kv_indices.device
    q = torch.arange(q_len, device=device).unsqueeze(1)
    kv = torch.arange(kv_len, device=device).unsqueeze(0)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return block_mask.mask_mod(zero, zero, q, kv).expand(q_len, kv_len)


def _dense_attention(module, query, key, value, attention_mask, scaling=None, **_kwargs):
    mask = dense_block_mask(attention_mask, query.shape[2], key.shape[2])
    if key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_dense_attention() -> str:
    import speculators.models.eagle3.attention  # noqa: F401 - registers the flex kernel
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(DENSE_ATTENTION, _dense_attention)
    return DENSE_ATTENTION


def choose_attention(device: torch.device, requested: str = "auto") -> str:
    """``flex`` (speculators' kernel; GPUs), ``dense`` (CPU-capable, same mask) or ``auto``."""
    register_dense_attention()
    if requested == "auto":
        return FLEX_ATTENTION if device.type == "cuda" else DENSE_ATTENTION
    if requested == "flex":
        if device.type == "cpu":
            raise StageError("--attention flex has no backward pass on the CPU: use --attention dense or auto")
        return FLEX_ATTENTION
    if requested == "dense":
        return DENSE_ATTENTION
    raise StageError(f"unknown --attention {requested!r}: choose auto, flex or dense")


def set_attention(config, implementation: str) -> None:
    config.transformer_layer_config._attn_implementation = implementation


# ---------------------------------------------------------------- model


def new_draft(config, d2t: np.ndarray, t2d: np.ndarray):
    """A freshly initialised speculators Eagle3DraftModel (verifier tensors loaded from the view)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel(config=config, t2d=torch.from_numpy(np.asarray(t2d, dtype=bool)),
                            d2t=torch.from_numpy(np.asarray(d2t, dtype=np.int64)))


def _loadable_class():
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers.modeling_utils import no_init_weights

    class LoadableEagle3DraftModel(Eagle3DraftModel):
        """Eagle3DraftModel that speculators 0.4.0.1's from_pretrained can construct (upstream PR #669)."""

        def __init__(self, config, t2d=None, d2t=None, verifier=None, verifier_attachment_mode=None):
            super().__init__(config, t2d=t2d, d2t=d2t)

        @classmethod
        def get_init_context(cls, is_quantized, _is_ds_init_called):
            # real tensors, not meta: __init__ copies the verifier's lm_head rows into them
            return [no_init_weights()]

        def _init_weights(self, module):
            # missing keys are only the verifier_* tensors __init__ already loaded: keep them
            return

    return LoadableEagle3DraftModel


def read_checkpoint_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import safe_open

    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        raise StageError(f"{weights} not found: {path} is not a draft checkpoint (run `pipeline train`)")
    with safe_open(str(weights), framework="pt") as fh:
        keys = set(fh.keys())  # noqa: SIM118
        if not {"d2t", "t2d"} <= keys:
            raise StageError(f"{weights} has no d2t/t2d tensors: not an EAGLE-3 draft with a vocab mapping")
        return fh.get_tensor("d2t"), fh.get_tensor("t2d")


def load_draft(path: Path, *, attention: str | None = None, verifier_view: Path | None = None):
    """Load a saved draft with speculators' config loader and ``from_pretrained``.

    The verifier tensors come from ``verifier_view``, else from a train output's ``verifier/`` beside the
    checkpoint (``OUT/draft`` or ``OUT/checkpoints/N``), else from the path recorded in config.json.
    """
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    path = Path(path)
    config = Eagle3SpeculatorConfig.from_pretrained(str(path))
    if verifier_view is None:
        verifier_view = next((d / "verifier" for d in (path.parent, path.parent.parent) if (d / "verifier" / VIEW_CONFIG).is_file()), None)
    if verifier_view is not None:
        config.speculators_config.verifier.name_or_path = str(Path(verifier_view).resolve())
    view = Path(config.speculators_config.verifier.name_or_path or "")
    if not (view / VIEW_CONFIG).is_file():
        raise StageError(f"verifier {view} recorded in {path}/config.json does not exist here: pass the train output's verifier/ dir")
    set_attention(config, attention or register_dense_attention())
    d2t, t2d = read_checkpoint_vocab(path)
    model = _loadable_class().from_pretrained(str(path), config=config, t2d=t2d, d2t=d2t)
    model.eval()
    return model
