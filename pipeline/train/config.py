"""The train stage's options: ``TrainConfig``, one field per command-line option (pipeline/options.py).

Owns the fields, their defaults and help texts, and the checks a config makes at construction; nothing
here imports torch, so that ``pipeline train --help`` and ``pipeline check-args train ...`` refuse or
answer before the training stack loads. The run itself is pipeline/train/stage.py's; the command line
pipeline/train/cli.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StageError
from pipeline.options import opt, validate


MIN_MAX_LEN = 2  # a packed batch holds at least one sample of two tokens: one position to train on


@dataclass(frozen=True)
class TrainConfig:
    """Options of the train stage; flags only override these defaults (the command line is made from these
    fields: pipeline/options.py)."""

    data: Path = opt(
        help="Hidden-states dir: read (offline: pipeline extract's), or written (online, hybrid)."
    )
    # verifier.safetensors + verifier.json
    verifier: Path = opt(help="Verifier weights dir (pipeline weights).")
    # layout: the module docstring
    out: Path = opt(help="Output dir: checkpoints/, draft/, summary.json, plots.")
    prepared: Path | None = opt(
        None, help="Dir with d2t.npy/t2d.npy/token_freq.pt [default: from data_config.json]."
    )
    # then data_config's `model`
    model: Path | None = opt(None, help="Target model dir, config.json only [default: verifier.json source].")
    epochs: int = opt(
        3, low=1, help="Total epochs of the run (a resumed run counts the epochs already done)."
    )
    lr: float = opt(1e-4, low=0, low_open=True, help="AdamW learning rate.")
    # draft tokens unrolled per position
    ttt_steps: int = opt(3, low=1, help="Training-time-test steps.")
    ttt_step_loss_decay: float = opt(1.0, low=0, help="The loss of TTT step j weighs decay**j.")
    num_layers: int = opt(1, low=1, help="Draft decoder layers.")
    intermediate_size: int | None = opt(None, low=1, help="Draft MLP width [default: the target's].")
    norm_before_residual: bool = opt(
        False,
        decls="--norm-before-residual/--no-norm-before-residual",
        help="speculators' Eagle3 option of that name.",
    )
    max_len: int = opt(
        2048, low=MIN_MAX_LEN, help="Tokens per packed batch."
    )  # samples are packed up to this length
    eval_fraction: float = opt(
        0.1, low=0, low_open=True, high=1, help="Share of samples held out."
    )  # for validation and acceptance
    held_out: str = opt(
        "shuffled",
        choices=("shuffled", "last"),
        help="Which samples are held out: a seeded shuffle's share, or the last ones, as `speculators train "
        "--train-data-ratio 1-F` splits what export-speculators writes (then both hold out the same ones).",
    )
    eval_k: int | None = opt(
        None, low=1, help="Draft tokens per position when measuring [default: --ttt-steps]."
    )
    eval_max_samples: int = opt(64, low=1, help="Held-out samples the acceptance is measured on.")
    seed: int = opt(0, low=0, high=2**32 - 1, help="Seeds python, numpy, torch, the split and the sampler.")
    resume: bool = opt(False, help="Continue from the last complete epoch in OUT/checkpoints.")
    overwrite: bool = opt(False, help="Replace an existing output dir.")
    stop_after_epochs: int | None = opt(
        None, low=1, help="Train at most N epochs now; continue later with --resume."
    )
    scheduler: str = opt("linear", choices=("linear", "cosine", "none"), help="Learning-rate schedule.")
    warmup_steps: int | None = opt(None, low=0, help="Scheduler warmup steps [default: 1% of all steps].")
    device: str = opt("auto", help="auto | cpu | cuda | cuda:N")  # torchrun: the local rank's GPU
    # see pipeline/train/draft.py
    attention: str = opt(
        "auto",
        choices=("auto", "flex", "dense"),
        help="Draft attention: flex (GPUs) or dense (any device); auto: flex on a GPU.",
    )
    fsdp: bool = opt(
        False,
        help="Under torchrun: shard the draft's weights, gradients and optimizer state over the processes "
        "(speculators' FSDP) instead of a full copy on each (DDP).",
    )
    num_workers: int | None = opt(
        None, low=0, high=1024, help="Data loader workers [default: 0 on CPU, 4 on GPU]."
    )
    save_dtype: str = opt(
        "bfloat16", choices=("bfloat16", "float16", "float32"), help="Dtype of the exported draft/ weights."
    )
    draft_vocab_size: int | None = opt(None, low=1, help="Expected draft vocab size (checked against d2t).")
    trust_remote_code: bool = opt(
        False,
        help="Read the target's config.json through its own Python code (e.g. Kimi-K2.5), not as plain JSON.",
    )
    online_eval: bool = opt(
        False,
        help="Also serve the draft with vLLM (EAGLE-3 speculative decoding) on "
        "held-out prompts and report vLLM's acceptance.",
    )
    online_prompts: int = opt(16, low=1, help="With --online-eval: held-out prompts to generate from.")
    online_max_tokens: int = opt(32, low=1, help="With --online-eval: greedy tokens per prompt.")
    states_mode: str = opt(
        "offline",
        choices=("offline", "online", "hybrid"),
        help="offline: train on the finished states in --data. online: produce states from --prepared with "
        "--model while the draft trains, into --data, deleting each after use; hybrid: keep what "
        "--states-budget holds and reuse it in later epochs, produce the rest again.",
    )
    states_budget: str | None = opt(
        None, help="online/hybrid: bytes of state files on disk at most (e.g. 500G, 2T, 64GiB)."
    )
    states_backend: str = opt(
        "auto",
        choices=("auto", "hf", "vllm"),
        help="online/hybrid: the extract backend; auto as `pipeline extract --backend auto`: hf where the "
        "weights fit one GPU, vllm where they do not (contract/backends.py).",
    )
    states_device: str = opt("auto", help="online/hybrid: the producing device (auto, cpu, cuda:N; hf).")
    states_tensor_parallel_size: int | None = opt(
        None,
        low=1,
        high=4096,
        help="online/hybrid, vllm producer: GPUs its engine spans, the first N visible ones "
        "[default: all visible]; the trainer's --device then names one past them.",
    )
    states_memory_share: float | None = opt(
        None,
        help="online/hybrid, vllm producer: its share of each of its GPUs' memory (vLLM's "
        "gpu_memory_utilization) [default: where the trainer runs on one of the engine's GPUs, the weights' "
        "share plus 0.2 within 0.3-0.85 (pipeline/train/share.py); else vLLM's own].",
    )
    states_producer: str = opt(
        "auto",
        choices=("auto", "thread", "process"),
        help="online/hybrid, vllm producer: where its engine runs: a process of its own (its Python off the "
        "trainer's GIL, its states come as files), or a thread of the trainer's process (the engine starts "
        "sooner, it trains slower: docs/train.md); auto: a process (a thread under torchrun would hang).",
    )
    states_dtype: str = opt("auto", help="online/hybrid: dtype of the states (as extract's --dtype).")
    layer_ids: tuple[int, ...] | None = opt(
        None, help="online/hybrid: captured decoder layers, comma-separated (default 2,L//2,L-3,L-1)."
    )
    states_max_batch_tokens: int = opt(
        32768, low=1, help="online/hybrid: padded tokens per producing forward."
    )
    states_max_batch_size: int = opt(64, low=1, help="online/hybrid: samples per producing forward at most.")
    checkpoint_steps: int | None = opt(
        None,
        low=1,
        help="Also checkpoint every N steps inside an epoch (resume then redoes none of them) "
        "[default: at epoch ends only].",
    )
    evaluate: bool = opt(True, decls="--no-eval", help="Skip the acceptance measurement.")  # and the plots
    plots: bool = opt(True, decls="--no-plots", help="Skip the PNG plots.")

    def __post_init__(self) -> None:
        validate(self)  # every number in its declared range (NaN and infinities refused), before any file
        if not self.eval_fraction < 1:
            raise StageError(
                f"--eval-fraction {self.eval_fraction} must be below 1: no sample would be trained on"
            )
        produced = self.states_mode != "offline"
        if produced:
            from pipeline.train.states import parse_bytes

            if self.states_budget is None:
                raise StageError(f"--states-mode {self.states_mode} needs --states-budget (bytes on disk)")
            parse_bytes(self.states_budget)
            from pipeline.train.share import check_share

            check_share(
                self.states_memory_share, None if self.states_backend == "auto" else self.states_backend
            )
            if self.states_producer != "auto" and self.states_backend == "hf":
                raise StageError(
                    f"--states-producer {self.states_producer} with --states-backend hf: only the vllm "
                    "producer's place is chosen (the hf producer is a thread of the trainer's); use "
                    "--states-backend vllm or leave --states-producer auto"
                )
            if self.states_tensor_parallel_size is not None and self.states_backend == "hf":
                raise StageError(
                    f"--states-tensor-parallel-size {self.states_tensor_parallel_size} with --states-backend "
                    "hf: the hf producer runs on one device (--states-device); use --states-backend vllm"
                )
            missing = [f for f, v in (("--prepared", self.prepared), ("--model", self.model)) if v is None]
            if missing:
                raise StageError(
                    f"--states-mode {self.states_mode} produces the states: it needs {' and '.join(missing)}"
                )
        else:
            given = [
                flag
                for flag, v, default in (
                    ("--states-budget", self.states_budget, None),
                    ("--layer-ids", self.layer_ids, None),
                    ("--states-backend", self.states_backend, "auto"),
                    ("--states-tensor-parallel-size", self.states_tensor_parallel_size, None),
                    ("--states-memory-share", self.states_memory_share, None),
                    ("--states-producer", self.states_producer, "auto"),
                )
                if v != default
            ]
            if given:
                raise StageError(f"{', '.join(given)}: only with --states-mode online or hybrid")
