"""The transformers backend: forward hooks on the chosen decoder layers of an HF causal LM.

Owns loading the model with transformers, finding its decoder layers (plain causal LMs and wrappers that
keep the text model under ``language_model``), padding a batch on the right with a correct attention
mask, and returning each sample's layer outputs with the padding stripped. The forward runs the decoder
stack only (no lm_head), and the hooks keep nothing but the chosen layers' outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.backends.base import Backend, BackendOptions, resolve_device, resolve_dtype
from pipeline.errors import StageError


def find_decoder(model: nn.Module, num_layers: int) -> tuple[nn.Module, nn.ModuleList]:
    """The module that runs the decoder stack, and its list of decoder layers."""
    candidates = []
    for name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers and hasattr(module, "embed_tokens"):
            candidates.append((name.count("."), name, module, layers))
    if not candidates:
        raise StageError(f"found no decoder with {num_layers} layers and embed_tokens in {type(model).__name__}")
    _, _, module, layers = min(candidates, key=lambda c: (c[0], c[1]))
    return module, layers


def load_causal_lm(options: BackendOptions, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            options.model.path, dtype=dtype, trust_remote_code=options.trust_remote_code, low_cpu_mem_usage=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise StageError(f"cannot load {options.model.path} with transformers: {str(exc).splitlines()[0]}") from None
    return model.to(device).eval()


class HFBackend(Backend):
    name = "hf"

    def __init__(self, options: BackendOptions):
        self.options = options
        self.device = resolve_device(options.device)
        self._dtype = resolve_dtype(options.dtype, self.device)
        self.model = load_causal_lm(options, self.device, self._dtype)
        self.decoder, layers = find_decoder(self.model, options.model.num_layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [layers[k].register_forward_hook(self._hook(k)) for k in options.layer_ids]
        self.pad_id = 0

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _hook(self, k: int):
        def hook(_module, _inputs, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.inference_mode()
    def forward_layers(self, batch: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], list[int]]:
        """Run one right-padded batch; return the captured [B, T_max, H] outputs (on device) and lengths."""
        lengths = [len(s) for s in batch]
        t_max = max(lengths)
        ids = torch.full((len(batch), t_max), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), t_max), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        self._captured.clear()
        self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        outs = [self._captured.pop(k) for k in self.options.layer_ids]
        return outs, lengths

    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        outs, lengths = self.forward_layers(batch)
        host = [o.to("cpu", non_blocking=False) for o in outs]
        # .clone(): each sample's tensors must own their storage, or torch.save writes the whole batch
        return [[h[i, :n].clone() for h in host] for i, n in enumerate(lengths)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.model = self.decoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
