"""The transformers backend: forward hooks on the chosen decoder layers of an HF causal LM.

Owns loading the model with transformers, finding its decoder layers (plain causal LMs and wrappers that
keep the text model under ``language_model``), laying a batch out for the forward, and returning each
sample's layer outputs. The forward runs the decoder stack only (no lm_head), and the hooks keep nothing
but the chosen layers' outputs. On a GPU nothing waits: the forward, the copies of each sample's rows to
the host (on a second stream) and the next batch's forward are queued at once.

Two layouts, the same states (tests compare every sample with its batch-of-one result):

- **padded** (the plain path, the default on the CPU): the batch right-padded to its longest sample.
  Right padding needs no attention mask: under causal attention a real token at position t < T_i only
  sees positions <= t, which are all real, and its position id is t either way. Passing no mask lets
  SDPA use its fused causal kernels instead of materialising a [B, heads, T, T] mask. Pad positions
  compute garbage that is never copied to the host.
- **packed** (the default on a GPU, where flash attention takes the model's heads: ``flash_fits``): the
  batch's samples end to end in one row, position ids restarting at each sample, and attention through
  ``packed_attention`` (registered with transformers' attention interface), which keeps each sample to
  itself: flash attention's variable-length kernel on a GPU, one causal SDPA per sample elsewhere. No
  token is padding, so no FLOP is spent on it.

On a GPU, for a run long enough to repay it, each decoder layer's forward is also ``torch.compile``d
(``dynamic=True``: one graph for every batch shape, shared by all layers), which fuses the norms, rotary
embedding, SiLU and residual adds that the eager forward runs as separate memory-bound kernels. Eager GPU runs
put their RMSNorms through torch's fused kernel instead (``fused_norms``: +16% on a 1.5B model, +10% on an 8B
one on the H200). The first compiled batch pays the compilation (~8 s on the H200 for a Llama layer with an
empty kernel cache, ~3.5 s with a warm one); against the fused eager loop it saves 0.58 us per token on a
1.5B model and 2.4 us on an 8B one, so it pays from ~2.7e16 and ~4.7e16 decoder FLOPs: runs planned above
``COMPILE_MIN_FLOPS`` compile (docs/benchmarks.md measures each lever).

On a GPU an MoE's routed experts run through vLLM's fused MoE kernel where vLLM is installed and a probe
proves it equal to transformers' own experts (``fused_experts``; --fused-experts): transformers' experts spend
a third of their time on the gather, sort and sum around their GEMMs, which vLLM's kernel does inside them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from torch import nn

from pipeline.backends import fused_experts, fused_norms
from pipeline.backends.base import (
    Backend,
    BackendOptions,
    Captured,
    DeviceClock,
    pinned_copy,
    resolve_device,
    resolve_dtype,
    split_rows,
    timed_part,
)
from pipeline.errors import StageError
from contract.experts import experts_met
from pipeline.model.experts import active_decoder_params
from pipeline.model.layer_profile import token_scales

PACKED_ATTENTION = "eagle_ops_packed"
COMPILE_MIN_FLOPS = 4e16  # 2 x decoder parameters met x planned tokens above which compiling pays for itself
# planned tokens from which fusing an MoE's experts pays for its start: 27.8 s more to the first batch, repaid
# at 1 / 81,641 - 1 / 99,017 s a token (dsv3-9b, H100, 2026-12-07: docs/benchmarks.md)
FUSE_EXPERTS_MIN_TOKENS = 13_000_000


def flash_fits(config) -> bool:
    """Whether flash attention's kernel takes this model's heads: query and value of one head size (MLA
    models, DeepSeek's, have 192 and 128; packing them would fall back to one SDPA per sample)."""
    v = getattr(config, "v_head_dim", None)
    return v is None or v == (getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None))


def should_compile(
    option: bool | None, on_gpu: bool, decoder_params: float, planned_tokens: int | None, moe: bool = False
) -> bool:
    """The compile decision: as asked; else on a GPU when the run's decoder FLOPs (or, unknown, always)
    reach ``COMPILE_MIN_FLOPS``; never on the CPU by default (inductor's C++ build takes minutes there).
    ``decoder_params``: those one token meets (an MoE's routed experts at k / E: pipeline/model/experts.py),
    so that an MoE is not credited with FLOPs its tokens never perform. Never an MoE by default: compiled
    layers ran dsv3-9b's loop at 0.69x eager's with transformers' grouped-GEMM experts (62.7k against 91.1k
    tok/s, H100, 2026-12-06; docs/benchmarks.md "The hf backend's MoE loop, by kind of kernel")."""
    if option is not None:
        return option
    return (
        not moe
        and on_gpu
        and (planned_tokens is None or 2 * decoder_params * planned_tokens >= COMPILE_MIN_FLOPS)
    )


def should_fuse_norms(option: bool | None, on_gpu: bool, compiled: bool) -> bool:
    """The fused-norm decision: as asked; else on a GPU when the layers run eagerly (compiled layers fuse
    their norms themselves; the CPU has no fused kernel to gain from)."""
    if option is not None:
        return option
    return on_gpu and not compiled


def should_fuse_experts(option: bool | None, on_gpu: bool, planned_tokens: int | None = None) -> bool:
    """The fused-experts decision: as asked; else on a GPU (vLLM's kernel is Triton's, for GPUs only) for a
    run of ``FUSE_EXPERTS_MIN_TOKENS`` or more (or of unknown length): the kernel's start (vLLM's import, the
    tile timings and Triton's compiles) delayed dsv3-9b's first batch by 28 s for a loop 1.21x as fast (H100,
    2026-12-07; docs/benchmarks.md "The hf backend's MoE experts through vLLM's fused kernel")."""
    if option is not None:
        return option
    return on_gpu and (planned_tokens is None or planned_tokens >= FUSE_EXPERTS_MIN_TOKENS)


def pinned_pool(stats: dict) -> dict:
    """What torch's pinned host allocator did (``torch.cuda.host_memory_stats()``): the blocks it pinned to
    grow its pool, their peak bytes (each rounded up to a power of two), and the seconds its CUDA calls took.
    Pinning runs on the thread that asks for a block: in the hf loop, the one that queues the copies, until
    the pool holds what a few batches in flight need (pure)."""
    return {
        "blocks_pinned": int(stats.get("num_host_alloc", 0)),
        "peak_bytes": int(stats.get("allocated_bytes.peak", 0)),
        "pin_seconds": float(stats.get("host_alloc_time.total", 0)) / 1e6,
    }


def find_decoder(model: nn.Module, num_layers: int) -> tuple[nn.Module, nn.ModuleList]:
    """The module that runs the decoder stack, and its list of decoder layers."""
    candidates = []
    for name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if (
            isinstance(layers, nn.ModuleList)
            and len(layers) == num_layers
            and hasattr(module, "embed_tokens")
        ):
            candidates.append((name.count("."), name, module, layers))
    if not candidates:
        raise StageError(
            f"found no decoder with {num_layers} layers and embed_tokens in {type(model).__name__}"
        )
    _, _, module, layers = min(candidates, key=lambda c: (c[0], c[1]))
    return module, layers


def init_cuda(device: torch.device) -> None:
    """CUDA's start on ``device``, before the load, so that its seconds are its own: the driver, the device's
    context (a first allocation and kernel). An indexed device becomes the current one: events, the clock and
    the copy stream use the current device's streams."""
    torch.cuda.init()
    if device.index is not None:
        torch.cuda.set_device(device)
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)


def load_causal_lm(
    options: BackendOptions, device: torch.device, dtype: torch.dtype, figures: dict[str, float] | None = None
) -> nn.Module:
    """The target with transformers: a causal LM, or for a wrapper whose config transformers has no causal-LM
    class for (Kimi-K2.5: ``Kimi_K25Config``) its image-text-to-text class, whose decoder sits under
    ``language_model`` (``find_decoder`` finds it; the vision tower is loaded and never run). Read into host
    memory, then moved to ``device``. ``figures`` gets each part's seconds: transformers' import (~0 where it
    was imported already), ``from_pretrained`` (every class tried), the move (on a GPU, to its copies' end).
    """
    figures = {} if figures is None else figures
    with timed_part(figures, "transformers_import_seconds"):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_classes = [AutoModelForCausalLM] + (
        [AutoModelForImageTextToText] if options.model.is_wrapper else []
    )
    for i, auto in enumerate(auto_classes):
        try:
            with timed_part(figures, "model_read_seconds"):
                model = auto.from_pretrained(
                    options.model.path,
                    dtype=dtype,
                    trust_remote_code=options.trust_remote_code,
                    low_cpu_mem_usage=True,
                )
            break
        except (OSError, ValueError, KeyError) as exc:
            unregistered = isinstance(exc, ValueError) and "Unrecognized configuration class" in str(exc)
            if unregistered and i + 1 < len(auto_classes):
                continue
            raise StageError(
                f"cannot load {options.model.path} with transformers: {str(exc).splitlines()[0]}"
            ) from None
    if dtype == torch.float32 and any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
        # transformers 5.19 dequantizes a compressed-tensors checkpoint's packed MoE experts to bf16 whatever
        # dtype was asked (DecompressExperts): fp32 asked is fp32 computed (bf16 -> fp32 is exact)
        model = torch.nn.Module.float(model)  # transformers refuses .float() on a quantized model
    with timed_part(figures, "model_to_device_seconds"):
        model = model.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return model.eval()


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    cu_seq_lens_q=None,
    max_length_q=None,
    **kwargs,
):
    """Causal attention within each sample of a packed row: query [1, heads, N, D], key/value
    [1, kv_heads, N, D], samples delimited by ``cu_seq_lens_q`` (int32 offsets, first 0, last N).
    Returns [1, N, heads, D] as transformers' attention functions do."""
    if cu_seq_lens_q is None:
        raise StageError("packed attention called without cu_seq_lens_q (the hf backend passes it)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, D]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == v.shape[-1]:
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, 0.0, True, False, scale=scaling
        )[0]
        return out[None], None
    bounds = cu_seq_lens_q.tolist()
    parts = []
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, T, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=ks.shape[1] != qs.shape[1]
        )
        parts.append(o[0].transpose(0, 1))
    return torch.cat(parts)[None], None


def use_packed_attention(decoder: nn.Module) -> None:
    """Make ``decoder`` attend through ``packed_attention``. A name transformers' mask interface does not know
    gets no mask built (the kernel is causal by itself), and position ids are ours."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    decoder.config._attn_implementation = PACKED_ATTENTION


class HFBackend(Backend):
    name = "hf"

    def __init__(self, options: BackendOptions, model: nn.Module | None = None):
        """Load ``options.model`` (or take ``model``, already on the device: benchmarks reuse one model for
        every variant; ``close()`` gives it back as it was)."""
        self.options = options
        self.device = resolve_device(options.device)
        self.startup: dict[str, float] = {}  # the load's parts in seconds: load_causal_lm's, the CUDA init
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise StageError(
                    f"device {options.device!r} asked for, but torch {torch.__version__} sees no CUDA device"
                )
            with timed_part(self.startup, "cuda_init_seconds"):
                init_cuda(self.device)
        self._dtype = resolve_dtype(options.dtype, self.device)
        if model is None:
            model = load_causal_lm(options, self.device, self._dtype, self.startup)
        self.model = model
        self.decoder, layers = find_decoder(self.model, options.model.num_layers)
        self._layers, self._attn_before = layers, self.decoder.config._attn_implementation
        on_gpu = self.device.type == "cuda"
        self.packed = on_gpu and flash_fits(self.decoder.config) if options.packed is None else options.packed
        self.params_met = active_decoder_params(  # per token: what --compile auto weighs a run by
            ((name, p.numel()) for name, p in self.decoder.named_parameters()),
            self.decoder.config.to_dict(),
        )
        moe = experts_met(self.decoder.config.to_dict()) != (0, 0)
        self.compiled = should_compile(options.compile, on_gpu, self.params_met, options.planned_tokens, moe)
        if self.packed:
            use_packed_attention(self.decoder)
        if self.compiled:
            for layer in layers:  # the hooks stay outside the compiled forward
                layer.forward = torch.compile(layer.forward, dynamic=True)
        fuse = should_fuse_norms(options.fused_norms, on_gpu, self.compiled)
        self.fused_norms = fused_norms.fuse(self.decoder) if fuse else []
        self.fused_experts: list[str] = []
        self.fused_experts_error: float | None = None  # the worst probe difference of the fused modules
        self.fused_experts_tiles: dict = {}  # per shape of experts: the tile sets timed, the one chosen
        if moe and should_fuse_experts(options.fused_experts, on_gpu, options.planned_tokens):
            with timed_part(self.startup, "fused_experts_seconds"):
                self.fused_experts, self.fused_experts_error, self.fused_experts_tiles = fused_experts.fuse(
                    self.decoder, options.max_batch_tokens, options.expert_tiles
                )
        if options.fused_experts and not self.fused_experts:
            raise StageError(
                "--fused-experts on, but no experts module of this model runs vLLM's fused MoE kernel (a "
                "dense model, vLLM not importable, no GPU, a layout it does not read, or its probe "
                "disagreed): use --fused-experts auto or off"
            )
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [layers[k].register_forward_hook(self._hook(k)) for k in options.layer_ids]
        self.pad_id = 0
        self.clock = DeviceClock(self.device)
        self._copies = torch.cuda.Stream(self.device) if on_gpu else None
        # the main thread's seconds in capture_async by part (``figures``): laying the batch out and queuing
        # its upload, queuing the forward (hooks included), queuing the facts and the copies to the host
        self._host = {"inputs_seconds": 0.0, "forward_queue_seconds": 0.0, "copies_queue_seconds": 0.0}

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _hook(self, k: int):
        def hook(_module, _inputs, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    def inputs(self, batch: Sequence[Sequence[int]]) -> tuple[dict, list[tuple[int, slice]]]:
        """The decoder's keyword arguments for one batch (queued to the device) and, per sample, where its
        rows are in a captured [rows, T, H] output: ``out[row, tokens]``."""
        lengths = [len(s) for s in batch]
        pinned = self.device.type == "cuda"  # pinned + non_blocking: no wait for the device's previous batch
        to = {"device": self.device, "non_blocking": True}
        if not self.packed:
            ids = torch.full((len(batch), max(lengths)), self.pad_id, dtype=torch.long, pin_memory=pinned)
            for i, s in enumerate(batch):
                ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            # causal attention: right padding needs no mask
            return {"input_ids": ids.to(**to), "use_cache": False}, [
                (i, slice(0, n)) for i, n in enumerate(lengths)
            ]
        ids = torch.empty((2, sum(lengths)), dtype=torch.long, pin_memory=pinned)  # token ids, position ids
        cu = torch.zeros(len(batch) + 1, dtype=torch.int32, pin_memory=pinned)
        rows, offset = [], 0
        for i, s in enumerate(batch):
            ids[0, offset : offset + len(s)] = torch.as_tensor(s, dtype=torch.long)
            ids[1, offset : offset + len(s)] = torch.arange(len(s))
            rows.append((0, slice(offset, offset + len(s))))
            offset += len(s)
            cu[i + 1] = offset
        ids = ids.to(**to)
        return {
            "input_ids": ids[:1],
            "position_ids": ids[1:],
            "use_cache": False,
            "cu_seq_lens_q": cu.to(**to),
            "max_length_q": max(lengths),
        }, rows

    @torch.inference_mode()
    def forward_layers(
        self, batch: Sequence[Sequence[int]]
    ) -> tuple[list[torch.Tensor], list[tuple[int, slice]]]:
        """Queue one batch; return the captured outputs (on the device) and where each sample's rows are."""
        t0 = time.perf_counter()
        kwargs, rows = self.inputs(batch)
        t1 = time.perf_counter()
        self._captured.clear()
        self.decoder(**kwargs)
        self._host["inputs_seconds"] += t1 - t0
        self._host["forward_queue_seconds"] += time.perf_counter() - t1
        return [self._captured.pop(k) for k in self.options.layer_ids], rows

    def figures(self) -> dict:
        """The loop's host side (issue #52): the main thread's seconds in each part of capture_async (on a
        GPU each part only queues work; on the CPU the forward runs in ``forward_queue_seconds``), the
        device's busy seconds (its clock: the forward stream between each batch's start and stop), and on a
        GPU the pinned host pool the copies grew (``pinned_pool``)."""
        figures = {**self._host, "device_busy_seconds": self.clock.seconds}
        if self.device.type == "cuda":
            figures["pinned_pool"] = pinned_pool(torch.cuda.host_memory_stats())
        return figures

    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        captured = self.capture_async(batch)
        captured.ready()
        return captured.states

    @torch.inference_mode()
    def capture_async(self, batch: Sequence[Sequence[int]]) -> Captured:
        """Each sample's rows go straight from the device into a host tensor of its own (pinned, from torch's
        caching host allocator, so reuse costs nothing): no host-side copy, padding never leaves the device.
        On a GPU the copies run on a second stream once the forward is done, so the next batch's forward
        overlaps them; ``ready()`` waits for them."""
        self.clock.start()
        outs, rows = self.forward_layers(batch)
        self.clock.stop()
        if self.device.type != "cuda":
            return Captured([[o[r].clone() for o in outs] for r in rows])
        # the closing check's per-token figures, on the device: one pass over each output there instead of two
        # per state on a writer thread (docs/vllm.md "The closing check"); padding rows are never looked at
        t0 = time.perf_counter()
        scales = [token_scales(o) for o in outs]
        computed = torch.cuda.Event()
        computed.record()
        with torch.cuda.stream(self._copies):
            self._copies.wait_event(computed)
            states, per_sample = split_rows(outs, rows, scales, pinned_copy)
            for t in [*outs, *(t for pair in scales for t in pair)]:
                t.record_stream(self._copies)  # not handed to the next forward before the copies ran
            copied = torch.cuda.Event()
            copied.record()
        self._host["copies_queue_seconds"] += time.perf_counter() - t0
        return Captured(states, copied.synchronize, per_sample)

    def close(self) -> None:
        if self.decoder is None:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for layer in self._layers:
            layer.__dict__.pop("forward", None)  # the compiled forward, if any: back to the class's
        fused_norms.restore(self.decoder, self.fused_norms)
        fused_experts.restore(self.decoder, self.fused_experts)
        self.decoder.config._attn_implementation = self._attn_before
        self.model = self.decoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
