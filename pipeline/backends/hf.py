"""The transformers backend: forward hooks on the chosen decoder layers of an HF causal LM.

Owns loading the model with transformers, finding its decoder layers (plain causal LMs and wrappers that
keep the text model under ``language_model``), padding a batch on the right, and returning each sample's
layer outputs with the padding stripped. The forward runs the decoder stack only (no lm_head), and the
hooks keep nothing but the chosen layers' outputs.

Right padding needs no attention mask: under causal attention a real token at position t < T_i only
sees positions <= t, which are all real, and its position id is t either way. Passing no mask lets SDPA
use its fused causal kernels instead of materialising a [B, heads, T, T] mask (tests compare every
sample with its batch-of-one result). Pad positions compute garbage that is cut off before anything is
copied to the host: the real rows of all samples are packed on the device and copied once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.backends.base import Backend, BackendOptions, DeviceClock, resolve_device, resolve_dtype
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
        self._pinned: torch.Tensor | None = None
        self.clock = DeviceClock(self.device)

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
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        self._captured.clear()
        self.decoder(input_ids=ids.to(self.device), use_cache=False)  # causal; right padding needs no mask
        outs = [self._captured.pop(k) for k in self.options.layer_ids]
        return outs, lengths

    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        self.clock.start()
        outs, lengths = self.forward_layers(batch)
        # pack the real rows of every sample and layer on the device: [layers, sum T, H], one copy to the host
        packed = torch.stack([torch.cat([o[i, :n] for i, n in enumerate(lengths)]) for o in outs])
        host = self._host_buffer(packed)
        host.copy_(packed, non_blocking=True)
        self.clock.stop()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.clock.settle()
        del packed, outs
        # .clone(): each sample's tensors must own their storage, or torch.save writes the whole batch
        result, start = [], 0
        for n in lengths:
            result.append([host[j, start : start + n].clone() for j in range(host.shape[0])])
            start += n
        return result

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``like``; on CUDA a reused pinned buffer (pinning is slow, reuse is free)."""
        if self.device.type != "cuda":
            return torch.empty(like.shape, dtype=like.dtype)
        if self._pinned is None or self._pinned.numel() < like.numel() or self._pinned.dtype != like.dtype:
            self._pinned = torch.empty(int(like.numel() * 1.25), dtype=like.dtype, pin_memory=True)
        return self._pinned[: like.numel()].view(like.shape)

    def close(self) -> None:
        self._pinned = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.model = self.decoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
