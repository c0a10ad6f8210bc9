"""The vLLM backend: vLLM's own hidden-state extraction (``extract_hidden_states``, vLLM >= 0.17)
behind Backend.

Owns the engine's construction (the speculative method, the KV connector that writes each request's states to
a file, the settings extraction needs, tensor parallel size; the CPU build's defaults come from
pipeline/runtime/vllm_cpu.py), the mapping of our layer ids to vLLM's, reading the files the connector writes,
and the validation of every result: one result per input in input order, the same token ids, exactly one [T,
H] state per requested layer and token. The field bug "1 of 4 layers kept", reordered results and states short
by whole blocks (prefix caching) fail here, loudly, instead of writing wrong files. The extract loop
(pipeline/extract/) owns batching, our output files, resume and progress; vLLM's scheduler packs each batch
into steps.

Why an in-process ``LLM`` rather than a ``vllm serve`` subprocess (docs/vllm.md): the extract loop already
owns batching, ordering and back-pressure, so a server would add an HTTP hop, a port and a second process
to supervise, and buy nothing; the engine's own worker processes run the model either way.

Layer ids: ours are decoder-layer OUTPUTS (k = output of layer k, pre final norm); vLLM's id j is the INPUT
of layer j, and j = num_hidden_layers is the last layer's output before the final norm. So ours map to
``k + 1`` (DESIGN.md section 10); ``vllm_layer_ids`` is the one place that says so.

Process model: at tensor parallel 1 the engine core and its one worker run in this process
(``engine_process``); at more, the core runs in a child process that spawns one worker per rank, so entry
points must be import-safe (``if __name__ == "__main__":``), which ``python -m pipeline`` is.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from contract import sizes
from pipeline.backends import vllm_scratch
from pipeline.backends.base import Backend, BackendOptions, Captured, visible_device_count
from pipeline.backends.vllm_feed import EngineFeed
from pipeline.runtime import vllm_cpu
from pipeline.errors import StageError

METHOD = "extract_hidden_states"
# ours (pipeline/backends/vllm_connector.py): vLLM's ExampleHiddenStatesConnector writing per-layer states and
# their facts; the engine imports it by module path. The reader also takes vLLM's own layout.
CONNECTOR = "EagleStatesConnector"
CONNECTOR_MODULE = "pipeline.backends.vllm_connector"
# What extraction needs from the engine, checked on the built engine (``settings``): prefix caching hands
# back states short by whole cached blocks; a chunked prefill would split a sample over several steps.
FORCED_SETTINGS = {"enable_prefix_caching": False, "enable_chunked_prefill": False}


def vllm_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM's aux layer ids for our captured layer OUTPUTS: the input of the next layer (k + 1)."""
    return [int(k) + 1 for k in layer_ids]


def default_tensor_parallel_size() -> int:
    return max(1, visible_device_count())


def check_patched() -> None:
    """Raise a one-line StageError unless the installed vLLM is one we have a patch set for, patched and
    with the APIs extraction uses (cheap: no model load)."""
    from pipeline.runtime.vllm_checks import installed_vllm_checks

    failed = [c for c in installed_vllm_checks() if c.failed]
    if failed:
        names = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        raise StageError(f"the installed vLLM is not ready for extraction ({names})")


def check_routing(options: BackendOptions) -> None:
    """Refuse a DeepSeek-style MoE config whose routing keys vLLM reads with other defaults than the
    checkpoint was trained with (vLLM would compute every MoE layer differently, silently): the check
    preflight makes too (pipeline/model/checkpoint.py)."""
    from pipeline.model.checkpoint import check_moe_routing, checkpoint_tensor_names

    raw = options.model.raw
    names, _ = checkpoint_tensor_names(options.model.path)
    failed = [r for r in check_moe_routing(names, raw.get("text_config") or raw) if r.failed]
    if failed:
        raise StageError(f"{options.model.path}/config.json: {failed[0].detail}")


def fp32_mla_on_gpu(raw: dict, dtype: str, on_gpu: bool, environ) -> int | None:
    """The ``kv_lora_rank`` of an MLA model (DeepSeek-V3, Kimi-K2.5) asked to run in float32 on a GPU, which
    vLLM 0.32's CUDA MLA attention backends cannot do (they take bf16 and fp16; the engine died in its start
    with "No valid attention backend found for cuda ... dtype=torch.float32, use_mla=True", the H200,
    2026-12-03); None for every other case: the CPU build runs such models without MLA (VLLM_MLA_DISABLE,
    pipeline/runtime/vllm_cpu.py), as does a GPU run whose operator set it (pure)."""
    text = raw.get("text_config") or raw
    if (
        on_gpu
        and dtype == "float32"
        and text.get("kv_lora_rank")
        and environ.get("VLLM_MLA_DISABLE", "0") in ("", "0")
    ):
        return int(text["kv_lora_rank"])
    return None


def check_attention_dtype(options: BackendOptions, on_gpu: bool, environ) -> None:
    """Refuse an fp32 MLA run on a GPU (`fp32_mla_on_gpu`) in one line, before anything loads."""
    rank = fp32_mla_on_gpu(options.model.raw, options.dtype, on_gpu, environ)
    if rank is not None:
        raise StageError(
            f"{options.model.path}: an MLA model (kv_lora_rank {rank}) cannot run in float32 "
            "on vLLM's GPU attention: use --dtype bfloat16 (or --backend hf for an fp32 reference)"
        )


def _vllm_dtype(dtype: str) -> str:
    if dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise StageError(f"unknown --dtype {dtype!r}: choose auto, bfloat16, float16 or float32")
    return dtype


# Planned tokens from which --compile auto compiles the model (vLLM's torch.compile, no CUDA graphs). On the
# H200 (docs/benchmarks-history.md, "2026-12-03 evening", llama-1b): a cold compile put the first batch 118 s
# later than eager (185 s against 67 s) and saved 1.3 us per token in the loop (139k against 118k tok/s), so
# it pays from ~90M tokens; from a warm cache (32 s to the first batch) it costs nothing at start.
COMPILE_MIN_TOKENS = 90_000_000


def should_compile(options: BackendOptions, on_gpu: bool) -> bool:
    """vLLM's compile decision: never with --enforce-eager; as asked by --compile on/off; else (auto) on a
    GPU for runs planned at ``COMPILE_MIN_TOKENS`` or more (never on the CPU build: its inductor build takes
    minutes there). CUDA graphs are never captured for extraction: its steps are prefills of up to
    ``max_num_batched_tokens`` tokens, past the largest size graphs are captured for (512 by default; 1,024
    on data-center Blackwell), so capturing them costs start-up and serves no step of the loop."""
    if options.enforce_eager:
        return False
    if options.compile is not None:
        return options.compile
    return on_gpu and (options.planned_tokens is None or options.planned_tokens >= COMPILE_MIN_TOKENS)


# The engine's step size in tokens (vLLM's max_num_batched_tokens) apart from the loop's --max-batch-tokens,
# for bench/capture_bench.py's step-size lever (issue #52); unset: --max-batch-tokens, as before
STEP_TOKENS_ENV = "EAGLE_VLLM_STEP_TOKENS"


def step_tokens(environ) -> int | None:
    """``EAGLE_VLLM_STEP_TOKENS`` as a positive int, None where unset; a bad value is a one-line error."""
    raw = environ.get(STEP_TOKENS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise StageError(f"{STEP_TOKENS_ENV}={raw!r}: expected a positive number of tokens")
    return int(raw)


def engine_arguments(
    options: BackendOptions,
    tensor_parallel_size: int,
    storage: Path,
    compiled: bool | None = None,
    step_tokens: int | None = None,
) -> dict:
    """The keyword arguments of ``vllm.LLM`` for an extraction run (pure: tests assert them). ``compiled``:
    torch.compile without CUDA graphs (True) or eager (False); None keeps the engine's defaults unless
    --enforce-eager. ``step_tokens``: the engine's step size (``EAGLE_VLLM_STEP_TOKENS``), else the loop's
    batch size."""
    args = dict(
        model=str(options.model.path),
        tensor_parallel_size=tensor_parallel_size,
        dtype=_vllm_dtype(options.dtype),
        max_model_len=options.seq_length,
        # without chunked prefill every sample must fit one step
        max_num_batched_tokens=max(step_tokens or options.max_batch_tokens, options.seq_length),
        trust_remote_code=options.trust_remote_code,
        speculative_config={
            "method": METHOD,
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_layer_ids(options.layer_ids)}
            },
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        },
        disable_log_stats=True,
        enforce_eager=options.enforce_eager if compiled is None else not compiled,
        # prompts are token ids and the one sampled token is dropped: no tokenizer is needed, so a model
        # folder without tokenizer files starts (vLLM would otherwise load one at engine start)
        skip_tokenizer_init=True,
    )
    args.update(FORCED_SETTINGS)
    if options.memory_share is not None:  # a trainer shares the GPU (pipeline/train/share.py)
        args["gpu_memory_utilization"] = options.memory_share
    if compiled:
        args["compilation_config"] = {"cudagraph_mode": "NONE"}
    if options.expert_parallel:
        # each rank holds E / ranks whole experts (instead of 1 / ranks of every expert) and, with the
        # filter, reads only those experts' tensors from the checkpoint at load
        args.update(enable_expert_parallel=True, enable_ep_weight_filter=True)
    if options.model.is_wrapper:
        # a vision-language wrapper (Kimi-K2.5) reads text only here: no vision tower built or loaded (its
        # memory stays free), no image profiling; vLLM ignores the flag for a model that is not multimodal
        args["language_model_only"] = True
    return args


@contextlib.contextmanager
def engine_process(in_process: bool):
    """Around the engine's construction: vLLM's engine core in this process (``in_process``: tensor parallel
    1, whose one worker then runs here too, so our connector hands the states over in memory) or in a
    process of its own (vLLM's default; a tensor-parallel engine's workers are processes either way). An
    operator's own VLLM_ENABLE_V1_MULTIPROCESSING wins. The variable is restored once the engine is built;
    vLLM's cache of its variables, which an engine built earlier in this process froze, is cleared first.
    Yields whether the engine core runs in this process."""
    from vllm import envs

    from pipeline.backends.vllm_connector import HANDOFF

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    if before is None:
        os.environ[key] = "0" if in_process else "1"
    envs.disable_envs_cache()
    HANDOFF.enable()  # taken only by a connector that runs in this process
    try:
        yield not envs.VLLM_ENABLE_V1_MULTIPROCESSING
    finally:
        if before is None:
            os.environ.pop(key, None)


@contextlib.contextmanager
def model_inspection_here():
    """Around the construction of an engine whose core runs in this process: vLLM's inspection of each model
    class (text generation? pipeline parallel? ...) runs here instead of in a fresh Python process. vLLM
    spawns one per class on a cold ``VLLM_CACHE_ROOT/modelinfos`` (the target and the extract_hidden_states
    drafter) so that importing a model's module cannot initialize CUDA in a parent that forks workers later;
    each one imports torch, transformers and vLLM again: 46 of the 77 s before the first batch on the H200
    (docs/benchmarks-history.md, 2026-12-04). An in-process core imports the same modules and initializes CUDA
    here anyway, so nothing is lost; vLLM still writes the result to its cache. vLLM's own behaviour when the
    pinned version lacks the hook (a test of the pinned wheel says so)."""
    from vllm.model_executor.models import registry

    spawn = getattr(registry, "_run_in_subprocess", None)
    if spawn is not None:
        registry._run_in_subprocess = _run_here
    try:
        yield
    finally:
        if spawn is not None:
            registry._run_in_subprocess = spawn


def _run_here(fn):
    return fn()


class VllmBackend(Backend):
    """A vLLM engine whose extract_hidden_states drafter writes each request's layer states to a file."""

    name = "vllm"
    _handoff = None  # the connector's in-memory hand-over, when the engine runs in this process

    def __init__(self, options: BackendOptions):
        if options.device not in ("auto", "cuda") and not (
            options.device == "cpu" and visible_device_count() == 0
        ):
            raise StageError(
                f"--device {options.device} is not supported by the vllm backend: "
                "it uses all visible devices "
                "(set CUDA_VISIBLE_DEVICES to choose them) and --tensor-parallel-size"
            )
        self.options = options
        self.tensor_parallel_size = options.tensor_parallel_size or default_tensor_parallel_size()
        if self.tensor_parallel_size < 1:
            raise StageError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        devices = visible_device_count()
        if devices and self.tensor_parallel_size > devices:
            raise StageError(
                f"--tensor-parallel-size {self.tensor_parallel_size} exceeds the {devices} visible GPU(s): "
                "lower it or make more devices visible"
            )
        if devices == 0:
            os.environ.update(vllm_cpu.extraction_environment(self.tensor_parallel_size))
        # vLLM's usage report (a thread posting this host's hardware and model facts to vLLM's authors, at
        # start and every 10 minutes) stays off outside the image too (the Dockerfile sets it there); an
        # operator's own value wins
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        check_patched()
        check_routing(options)
        check_attention_dtype(options, on_gpu=devices > 0, environ=os.environ)
        from pipeline.backends.vllm_connector import HANDOFF

        if HANDOFF.connected:
            raise StageError(
                "a vLLM engine whose core runs in this process is still open: close it before building "
                "another (vLLM's close of an in-process engine destroys the model-parallel groups that every "
                "engine of the process shares, and the in-memory hand-over of states is one per process)"
            )
        self.layer_ids = [int(k) for k in options.layer_ids]
        # the connector's files live here only until a writer thread has read them (vllm_scratch.py)
        need = vllm_scratch.in_flight_bytes(
            max(options.max_batch_tokens, options.seq_length),
            len(self.layer_ids),
            options.model.hidden_size,
            sizes.dtype_bytes(options.dtype),
        )
        where = vllm_scratch.choose(options.scratch_dir or Path(tempfile.gettempdir()), need)
        self.scratch_reason = where.reason
        self._scratch = vllm_scratch.Scratch(where.root)
        self._storage = self._scratch.path
        from vllm import LLM, SamplingParams

        try:
            self.compiled = should_compile(options, on_gpu=devices > 0)
            args = engine_arguments(
                options, self.tensor_parallel_size, self._storage, self.compiled, step_tokens(os.environ)
            )
            if devices == 0:
                args.update(vllm_cpu.engine_arguments(args["dtype"]))
            with contextlib.ExitStack() as stack:
                if stack.enter_context(engine_process(in_process=self.tensor_parallel_size == 1)):
                    stack.enter_context(model_inspection_here())
                self._llm = LLM(**args)
        except BaseException:
            HANDOFF.disable()
            self._scratch.close()
            release_device_memory()
            raise
        # tensor parallel 1, engine core in this process: the connector hands each request's states over in
        # memory (vllm_connector.Handoff); else its worker writes them to files in the scratch folder
        self._handoff = HANDOFF if HANDOFF.connected else None
        self.handoff = "memory" if self._handoff is not None else "files"
        print(
            "vllm backend: "
            + (
                "the engine runs in this process and hands each request's states over in memory"
                if self._handoff is not None
                else f"the engine's per-request files wait in {where.reason}"
            ),
            file=sys.stderr,
        )
        self.profile = Profile(self.handoff)
        # no detokenizer: the engine has none (skip_tokenizer_init) and the one sampled token is not kept
        self._feed = EngineFeed(self._llm, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
        config = self._llm.llm_engine.vllm_config
        self._dtype = config.model_config.dtype
        self.settings = {
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
            "enforce_eager": config.model_config.enforce_eager,
            "block_size": config.cache_config.block_size,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            "kv_connector": config.kv_transfer_config.kv_connector,
            "kv_connector_module_path": config.kv_transfer_config.kv_connector_module_path,
            "aux_layer_ids": list(
                config.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids
            ),
        }
        wrong = {k: self.settings[k] for k, v in FORCED_SETTINGS.items() if self.settings[k] != v}
        if (self.settings["kv_connector"], self.settings["kv_connector_module_path"]) != (
            CONNECTOR,
            CONNECTOR_MODULE,
        ):
            wrong["kv_connector"] = (self.settings["kv_connector"], self.settings["kv_connector_module_path"])
        if self.settings["aux_layer_ids"] != vllm_layer_ids(self.layer_ids):
            wrong["aux_layer_ids"] = self.settings["aux_layer_ids"]
        if wrong:
            self.close()
            raise StageError(
                f"vLLM did not take the extraction settings: {wrong} (expected {FORCED_SETTINGS} and "
                f"aux layers {vllm_layer_ids(self.layer_ids)})"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        return self.capture_async(batch).wait_all()

    def capture_async(self, batch: Sequence[Sequence[int]]) -> Captured:
        """Queue the batch's requests behind those already in the engine and return at once: each sample's
        states are allocated empty, and its ``ready`` (run by the writer thread that writes it) waits for its
        request, reads and checks its file into them, and deletes the file."""
        if not batch:
            return Captured([])
        from vllm.inputs import TokensPrompt

        seqs = [[int(t) for t in s] for s in batch]
        limit = self.options.seq_length - 1
        too_long = [i for i, s in enumerate(seqs) if len(s) > limit or not s]
        if too_long:
            i = too_long[0]
            raise StageError(
                f"sample {i} of the batch has {len(seqs[i])} tokens; the vllm backend takes 1..{limit} "
                "(seq_length - 1): re-run prepare with this --seq-length"
            )
        try:
            futures = self._feed.submit([TokensPrompt(prompt_token_ids=s) for s in seqs])
        except Exception as exc:  # noqa: BLE001 - the engine's own error, in one line
            raise StageError(f"the vLLM engine stopped: {type(exc).__name__}: {exc}") from exc
        hidden = self.options.model.hidden_size
        states = [[torch.empty(len(s), hidden, dtype=self._dtype) for _ in self.layer_ids] for s in seqs]
        # filled by each sample's ready: the facts the connector computed (or, from vLLM's own layout, here)
        scales: list[list] = [[] for _ in seqs]
        readies = [
            _Once(lambda k=k: self._fill(k, seqs[k], futures[k], states[k], scales[k]))
            for k in range(len(seqs))
        ]
        return Captured(
            states,
            scales=scales,
            sample_ready=readies,
            discard=lambda k: readies[k].skip(lambda: self._drop(futures[k])),
        )

    def _fill(
        self, k: int, seq: list[int], future: Future, into: list[torch.Tensor], scales_into: list
    ) -> None:
        t0 = time.perf_counter()
        try:
            output = future.result()
        except Exception as exc:  # noqa: BLE001 - the engine's own error, in one line
            raise StageError(f"the vLLM engine stopped: {type(exc).__name__}: {exc}") from exc
        t1 = time.perf_counter()
        self._read(k, seq, output, into, scales_into)
        self.profile.add(engine_wait=t1 - t0, read=time.perf_counter() - t1, samples=1)

    def _drop(self, future: Future) -> None:
        """A request whose states nobody reads (its sample is already on disk, a resumed batch): its entry
        is dropped from the hand-over, or its file removed on a thread of its own once the connector's write
        releases the lock (the callback runs on the engine thread, which must not wait on a file)."""

        def remove(done: Future) -> None:
            if done.exception() is None:
                path = (done.result().kv_transfer_params or {}).get("hidden_states_path")
                if path and self._handoff is not None:
                    self._handoff.drop(path)
                elif path:
                    threading.Thread(target=_remove_when_written, args=(path,), daemon=True).start()

        future.add_done_callback(remove)

    def _read(
        self,
        i: int,
        seq: list[int],
        output,
        into: list[torch.Tensor] | None = None,
        scales_into: list | None = None,
    ) -> list[torch.Tensor]:
        """Sample i's states, checked: from the in-memory hand-over, or from the connector's file (waiting on
        its write's lock; the file is removed after). With ``into`` (the sample's list of states, allocated
        empty and never touched) the list's entries are replaced, so the writer holding that list sees them;
        ``scales_into`` gets each state's ``token_scales`` (the connector's, else computed here)."""
        from pipeline.model.layer_profile import token_scales

        if list(output.prompt_token_ids or []) != seq:
            raise StageError(
                f"vLLM result {i} belongs to another input (prompt tokens differ): results out of input order"
            )
        path = (output.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise StageError(
                f"vLLM result {i} names no hidden-states file "
                f"(kv_transfer_params={output.kv_transfer_params}): "
                f"is the {CONNECTOR} connector active?"
            )
        if self._handoff is not None:
            tensors = self._handoff.take(path, self._feed.check_alive)
        else:
            tensors = _read_file(i, path)
        states, facts = request_states(i, seq, tensors, len(self.layer_ids), self.options.model.hidden_size)
        if into is not None:
            into[:] = states
        if scales_into is not None:
            scales_into[:] = facts if facts is not None else [token_scales(h) for h in states]
        return states

    def figures(self) -> dict:
        """The loop's figures on this side (the extract stats' ``backend``): the feed's engine steps, the
        writer threads' waits (``Profile``), and where the engine runs in this process our connector's
        ``STATS`` (its levers, the engine thread's seconds in it, the bytes and copy-stream seconds, the
        steps' scheduled tokens)."""
        feed = self._feed
        out = {
            "engine_steps_stepped": feed.steps if feed is not None else None,
            "handoff": self.handoff,
            "samples_read": self.profile.samples,
            "engine_wait_seconds": self.profile.engine_wait,
            "read_seconds": self.profile.read,
            "max_num_batched_tokens": self.settings["max_num_batched_tokens"],
        }
        if self._handoff is not None:
            from pipeline.backends.vllm_connector import STATS

            out["connector"] = STATS.figures()
        return out

    def close(self) -> None:
        feed = getattr(self, "_feed", None)
        if feed is not None and self.profile.samples:
            connector = self.figures().get("connector")
        self._feed = None
        if feed is not None:
            feed.close()
            if self.profile.samples:
                print(f"vllm backend: {feed.steps} engine steps; {self.profile.line()}", file=sys.stderr)
                if connector:
                    print(f"vllm backend: {connector_line(connector)}", file=sys.stderr)
        llm = getattr(self, "_llm", None)
        self._llm = None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if self._handoff is not None:
            self._handoff.disable()
        scratch = getattr(self, "_scratch", None)
        self._scratch = None
        if scratch is not None:
            scratch.close()
        if llm is not None:
            del feed, llm  # the last references to the engine: what is collected below
            release_device_memory()


def release_device_memory() -> None:
    """Give the GPU memory of an engine this process no longer holds back to the device. The engine's model,
    KV cache (vLLM's ``gpu_memory_utilization`` share: 129 of the H200's 140 GiB) and activations were torch
    tensors: dropping them returns their blocks to torch's caching allocator, not to the device, so a
    ``vllm serve`` or a second engine started after close() found 10.7 GiB free and refused to start (the
    H200, 2026-12-04). Collect first: the engine's objects hold each other in cycles."""
    import gc

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _remove_when_written(path: str) -> None:
    """Wait for the connector's write of ``path`` (its lock), then remove the file and its lock."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
    )

    try:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
    except OSError:
        pass  # no lock: nothing is being written; the scratch folder goes at close() in any case
    cleanup_hidden_states(path)


def _read_file(i: int, path: str) -> dict:
    """The tensors of the connector's file for sample i, once its write released the lock; the file and its
    lock are removed whatever happens."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
    )

    try:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the connector's writer releases LOCK_EX
            return load_file(path, device="cpu")
    except (OSError, ValueError, SafetensorError) as exc:
        raise StageError(
            f"cannot read vLLM's hidden states of sample {i} from {path}: {exc} "
            "(vLLM's log says why the write failed: 'Hidden-states write failed')"
        ) from None
    finally:
        cleanup_hidden_states(path)


def request_states(
    i: int, seq: list[int], tensors: dict, layers: int, hidden: int
) -> tuple[list[torch.Tensor], list | None]:
    """Sample i's per-layer ``[T, H]`` states from one request's tensors, and their facts where the
    connector computed them (else None), after checking that they are for ``seq``'s tokens and have one
    state per layer and token. Our connector's layout (``hidden_states.{j}`` with ``token_rms.{j}`` and
    ``nonfinite.{j}``) is taken as it is; vLLM's own (one ``[T, layers, H]`` ``hidden_states`` block) is
    split here."""
    want = (len(seq), layers, hidden)
    ids = tensors.get("token_ids")
    per_layer = sorted((x for x in tensors if x.startswith("hidden_states.")), key=lambda x: int(x[14:]))
    if ids is None or not (per_layer or "hidden_states" in tensors):
        raise StageError(
            f"vLLM's states of sample {i} lack token_ids or hidden_states (has {sorted(tensors)})"
        )
    if ids.tolist() != seq:
        raise StageError(
            f"vLLM's states of sample {i} are for other tokens ({len(ids)} ids, expected {len(seq)}): "
            "results out of input order or a prefix-cache hit"
        )
    if not per_layer:
        block = tensors["hidden_states"]
        shape = tuple(block.shape)
        states = [block[:, j].contiguous() for j in range(layers)] if shape == want else []
    else:
        states = [tensors[x] for x in per_layer]
        odd = [tuple(h.shape) for h in states if tuple(h.shape) != (len(seq), hidden)]
        shape = (len(seq), len(states), hidden) if not odd else (odd[0][0], len(states), *odd[0][1:])
    if shape != want or (per_layer and per_layer != [f"hidden_states.{j}" for j in range(layers)]):
        raise StageError(
            f"vLLM's states of sample {i} have shape {shape}, expected {want} (tokens, one per layer, hidden)"
        )
    facts = None
    if per_layer and all(f"token_rms.{j}" in tensors and f"nonfinite.{j}" in tensors for j in range(layers)):
        facts = [(tensors[f"token_rms.{j}"], tensors[f"nonfinite.{j}"]) for j in range(layers)]
    return states, facts


def connector_line(c: dict) -> str:
    """The connector's ``STATS.figures()`` in one line (the run's stderr)."""
    copy = c["copy_stream_seconds"]
    return (
        f"connector levers {c['levers'] or 'none'}: {c['save_steps']} step saves of "
        f"{c['requests']} requests, "
        f"{c['bytes_copied'] / 1e9:.2f} GB copied"
        + (f" in {copy:.2f} s of copy stream" if copy is not None else "")
        + f"; engine thread {c['engine_thread_seconds']:.2f} s in it"
        + (f", its own thread {c['connector_thread_seconds']:.2f} s" if c["connector_thread_seconds"] else "")
        + f"; {c['engine_steps']} engine steps of {c['step_tokens_mean']:,.0f} tokens on average "
        f"(max {c['step_tokens_max']:,})"
    )


class Profile:
    """Where the writer threads' time on vLLM's results went, summed over threads (thread-safe): waiting for
    the engine to finish a request, and receiving its states (``handoff`` "memory": waiting for the device
    copy; "files": the connector's write still running under the lock, the load), with the checks."""

    def __init__(self, handoff: str = "files"):
        self._lock = threading.Lock()
        self.handoff = handoff
        self.engine_wait = self.read = 0.0
        self.samples = 0

    def add(self, engine_wait: float, read: float, samples: int) -> None:
        with self._lock:
            self.engine_wait += engine_wait
            self.read += read
            self.samples += samples

    def line(self) -> str:
        n = max(1, self.samples)
        how = "taking its states from memory" if self.handoff == "memory" else "reading its file"
        return (
            f"{self.samples} samples read; per sample {1e3 * self.engine_wait / n:.1f} ms waiting for the "
            f"engine, {1e3 * self.read / n:.1f} ms {how} (thread-seconds)"
        )


class _Once:
    """A sample's ``ready``: runs its read once (thread-safe); later calls return, or raise its error again.
    ``skip`` runs another action instead when the read has not run (a sample nobody will read)."""

    def __init__(self, fn):
        self._fn = fn
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def __call__(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                try:
                    self._fn()
                except BaseException as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error

    def skip(self, instead) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                instead()
