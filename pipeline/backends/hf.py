"""The transformers backend: forward hooks on the chosen decoder layers of an HF causal LM.

Owns loading the model with transformers, finding its decoder layers (plain causal LMs and wrappers that
keep the text model under ``language_model``), padding a batch on the right, and returning each sample's
layer outputs with the padding stripped. The forward runs the decoder stack only (no lm_head), and the
hooks keep nothing but the chosen layers' outputs. On a GPU nothing waits: the forward, the copies of
each sample's rows to the host (on a second stream) and the next batch's forward are queued at once.

Right padding needs no attention mask: under causal attention a real token at position t < T_i only
sees positions <= t, which are all real, and its position id is t either way. Passing no mask lets SDPA
use its fused causal kernels instead of materialising a [B, heads, T, T] mask (tests compare every
sample with its batch-of-one result). Pad positions compute garbage that is never copied to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.backends.base import Backend, BackendOptions, Captured, DeviceClock, resolve_device, resolve_dtype
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
        if self.device.type == "cuda" and self.device.index is not None:
            # events, the clock and the copy stream use the current device's streams: make it the model's
            torch.cuda.set_device(self.device)
        self._dtype = resolve_dtype(options.dtype, self.device)
        self.model = load_causal_lm(options, self.device, self._dtype)
        self.decoder, layers = find_decoder(self.model, options.model.num_layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [layers[k].register_forward_hook(self._hook(k)) for k in options.layer_ids]
        self.pad_id = 0
        self.clock = DeviceClock(self.device)
        self._copies = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _hook(self, k: int):
        def hook(_module, _inputs, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.inference_mode()
    def forward_layers(self, batch: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], list[int]]:
        """Queue one right-padded batch; return the captured [B, T_max, H] outputs (on device) and lengths."""
        lengths = [len(s) for s in batch]
        t_max = max(lengths)
        ids = torch.full((len(batch), t_max), self.pad_id, dtype=torch.long, pin_memory=self.device.type == "cuda")
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        self._captured.clear()
        # pinned + non_blocking: the host does not wait for the device's previous batch to queue this one
        self.decoder(input_ids=ids.to(self.device, non_blocking=True), use_cache=False)  # causal: no mask needed
        outs = [self._captured.pop(k) for k in self.options.layer_ids]
        return outs, lengths

    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        captured = self.capture_async(batch)
        captured.ready()
        return captured.states

    @torch.inference_mode()
    def capture_async(self, batch: Sequence[Sequence[int]]) -> Captured:
        """Each sample's real rows go straight from the device into a host tensor of its own (pinned, from
        torch's caching host allocator, so reuse costs nothing): no packing, no host-side copy, padding never
        leaves the device. On a GPU the copies run on a second stream once the forward is done, so the next
        batch's forward overlaps them; ``ready()`` waits for them."""
        self.clock.start()
        outs, lengths = self.forward_layers(batch)
        self.clock.stop()
        if self.device.type != "cuda":
            return Captured([[o[i, :n].clone() for o in outs] for i, n in enumerate(lengths)])
        computed = torch.cuda.Event()
        computed.record()
        with torch.cuda.stream(self._copies):
            self._copies.wait_event(computed)
            states = []
            for i, n in enumerate(lengths):
                row = []
                for o in outs:
                    h = torch.empty((n, o.shape[-1]), dtype=o.dtype, pin_memory=True)
                    h.copy_(o[i, :n], non_blocking=True)
                    row.append(h)
                states.append(row)
            for o in outs:  # the allocator must not hand this memory to the next forward before the copies ran
                o.record_stream(self._copies)
            copied = torch.cuda.Event()
            copied.record()
        return Captured(states, copied.synchronize)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.model = self.decoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
