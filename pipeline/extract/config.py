"""``ExtractConfig``: every option of ``pipeline extract`` and what it validates on its own (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contract.summary import CLOSING_CHECKS
from pipeline.backends import BACKENDS
from pipeline.errors import StageError
from pipeline.model.experts import expert_parallel_refusal
from pipeline.options import opt, validate
from pipeline.extract.writer import WRITER_THREADS

# an auto|on|off option's value as BackendOptions takes it (None: the backend decides)
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class ExtractConfig:
    """Options of the extract stage (the command line is made from these fields: pipeline/options.py).
    Checks that need no file, model or device run at construction, so `pipeline check-args` refuses them."""

    prepared: Path = opt(help="Output of `pipeline prepare`.")
    model: Path = opt(help="Target model directory.")
    # data_{i}.pt, data_config.json, sample_lengths.json
    out: Path = opt(help="Hidden-states directory to write.")
    backend: str = opt(
        "auto",
        choices=("auto", *BACKENDS),
        help="hf: transformers with hooks; vllm: vLLM's extract_hidden_states; auto: hf where the weights "
        "fit one GPU, vllm where they do not (contract/backends.py says why).",
    )
    layer_ids: tuple[int, ...] | None = opt(
        None, help="Comma-separated decoder layer ids (default 2,L//2,L-3,L-1)."
    )
    device: str = opt("auto", help="auto, cpu, cuda, cuda:N (hf backend).")
    dtype: str = opt("auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32.")
    max_batch_tokens: int = opt(32768, help="Padded tokens per forward.")
    compile: str = opt(
        "auto",
        choices=tuple(AUTO_ON_OFF),
        help="torch.compile the model (auto: on a GPU, for runs long enough to repay it; vllm: never "
        "CUDA graphs).",
    )
    fused_experts: str = opt(
        "auto",
        choices=tuple(AUTO_ON_OFF),
        help="hf backend, an MoE target: its routed experts through vLLM's fused MoE kernel, where a probe "
        "proves it equal to transformers' experts (auto: on a GPU, for runs of 13M tokens or more, which "
        "repay its ~30 s start; on: fail if none can be).",
    )
    max_batch_size: int = opt(64, help="Samples per forward at most.")
    limit: int | None = opt(None, low=1, help="Only the first N samples.")
    resume: bool = opt(False, help="Continue an interrupted run in --out.")
    repair: bool = opt(False, help="With --resume: check existing files and regenerate damaged ones.")
    overwrite: bool = opt(False, help="Delete --out first.")
    tensor_parallel_size: int | None = opt(
        None, low=1, high=4096, help="vllm backend: default all visible devices."
    )
    enforce_eager: bool = opt(
        False, help="vllm backend: no CUDA graphs or torch.compile (faster start, slower loop)."
    )
    expert_parallel: bool = opt(
        False,
        help="vllm backend, an MoE target over several GPUs: each GPU holds whole experts and reads only "
        "their weights, instead of a slice of every expert (vLLM's expert parallelism).",
    )
    trust_remote_code: bool = opt(False, help="Allow the model's own Python code (e.g. Kimi-K2.5).")
    verify: bool = opt(True, decls="--no-verify", help="Skip the summary.json check at the end.")
    closing_check: str = opt(
        "record",
        help="The check writing summary.json: record (each file's size and mtime, and "
        "the values its writer recorded; reads no state back) or full (reads "
        "and hashes every byte, as `pipeline verify`).",
    )
    progress: bool = opt(True, decls="--no-progress", help="No progress bar (logs, CI).")
    writer_threads: int = opt(
        WRITER_THREADS,
        help="Threads writing files (hashing and copying into the page cache), per process.",
    )
    data_parallel: int = opt(
        1, help="Processes on this host: hf one per GPU; vllm one per --tensor-parallel-size GPUs."
    )
    # host `rank` owns samples i with i % world_size == rank
    world_size: int = opt(1, help="Hosts sharing the set (sample i -> host i %% W).")
    rank: int = opt(0, help="This host's rank in --world-size.")
    # set by the launcher for each of its --data-parallel workers (worker_config), never on the command line
    local_rank: int | None = opt(None, cli=False, help="This worker's slot in a --data-parallel run.")

    def __post_init__(self) -> None:
        validate(self)
        if self.max_batch_tokens < 1 or self.max_batch_size < 1:
            raise StageError(
                f"--max-batch-tokens {self.max_batch_tokens} and --max-batch-size {self.max_batch_size} "
                "must be at least 1"
            )
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise StageError(
                f"--rank {self.rank} must be in 0..{self.world_size - 1} for --world-size {self.world_size}"
            )
        if self.closing_check not in CLOSING_CHECKS:
            raise StageError(
                f"unknown --closing-check {self.closing_check!r}: choose {' or '.join(CLOSING_CHECKS)}"
            )
        if self.writer_threads < 1:
            raise StageError(f"--writer-threads {self.writer_threads} must be at least 1")
        if self.data_parallel < 1:
            raise StageError(f"--data-parallel {self.data_parallel} must be at least 1")
        if self.expert_parallel and self.backend == "hf":  # auto is told apart once it has chosen (stage.py)
            raise StageError(expert_parallel_refusal(self.backend))
        if self.fused_experts == "on" and self.backend == "vllm":  # vLLM's engine fuses its MoE by itself
            raise StageError(
                "--fused-experts on is the hf backend's (the vllm backend runs vLLM's fused MoE by itself): "
                "drop --fused-experts or pass --backend hf"
            )
        if self.data_parallel > 1 and self.device.startswith("cuda:"):
            raise StageError(
                f"--data-parallel gives each worker one GPU of its own; drop --device {self.device} "
                "(choose the GPUs with CUDA_VISIBLE_DEVICES)"
            )
