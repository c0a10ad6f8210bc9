"""A stage's parallel layout on one host: backend, tensor parallel size, data parallel processes.

Owns the rules that turn the hosts file's `backend`, `tensor_parallel_size` and `data_parallel` (each may
be "auto"/0) into the exact flags of `pipeline extract`, given what the preflight found: the host's GPU
count and memory, the checkpoint's weight bytes and whether the image has vLLM. Backend "auto" follows
contract/backends.py, the rule `pipeline extract --backend auto` follows too: hf where the weights fit one
GPU (its loop measured faster), vLLM where they do not (the reference host: one 8-GPU box serving a
Kimi-K2.5-sized model), with tensor parallel over all GPUs and one process. With the hf backend the GPUs
are shared out by data parallelism instead (one process per GPU).
Flags the operator passed after `--` win over the hosts file. Pure: probing is ops.preflight's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.backends import choose
from ops.errors import ConfigError
from ops.stageargs import StageArgs

AUTO = "auto"
BACKENDS = ("vllm", "hf")


@dataclass(frozen=True)
class Layout:
    """As configured (backend "auto", sizes 0 = auto) or resolved (every field concrete)."""

    backend: str = AUTO  # auto | vllm | hf
    tensor_parallel_size: int = 0  # vllm: 0 = all GPUs of the host
    data_parallel: int = 0  # hf: processes, one GPU each; 0 = one per GPU (vllm: always 1)
    # resolved: why this backend (auto's rule, or "as configured"); not part of the layout's identity
    reason: str = field(default="", compare=False)

    @property
    def resolved(self) -> bool:
        return self.backend != AUTO and self.tensor_parallel_size > 0 and self.data_parallel > 0


def visible_gpus(docker_gpus: str, host_gpus: int) -> int:
    """GPUs the stage container gets from `docker run --gpus VALUE`: all of them, a count, or a device
    list."""
    value = docker_gpus.strip()
    if value.startswith(("device=", '"device=')):
        return len([d for d in value.split("=", 1)[1].strip('"').split(",") if d.strip()])
    if value.isdigit():
        return min(int(value), host_gpus)
    return host_gpus


def needs_image_probe(configured: Layout, args: StageArgs = StageArgs()) -> bool:
    """Whether resolving takes a look into the image (backend auto and not given after `--`)."""
    return configured.backend == AUTO and args.backend is None


def resolve(
    configured: Layout,
    *,
    gpus: int,
    image_has_vllm: bool | None,
    args: StageArgs = StageArgs(),
    weights_bytes: int | None = None,
    gpu_memory_bytes: int | None = None,
    experts: tuple[int, int] = (0, 0),
    dequantized_extra: int = 0,
) -> Layout:
    """The concrete layout for a host with `gpus` GPUs visible to the stage (each of `gpu_memory_bytes`,
    the checkpoint `weights_bytes`, `experts` its MoE's (k, E) routed experts: contract/experts.py).
    ConfigError for one that cannot run: more GPUs asked for than there are, data parallelism with vLLM."""
    backend = args.backend or configured.backend
    reason = "as given after --" if args.backend else "as configured"
    if backend == AUTO:
        choice = choose(
            weights_bytes, gpu_memory_bytes, max(gpus, 1), bool(image_has_vllm), experts, dequantized_extra
        )
        backend, reason = choice.backend, choice.reason
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is not one of auto, {', '.join(BACKENDS)}")
    tp = args.tensor_parallel_size or configured.tensor_parallel_size
    dp = args.data_parallel or configured.data_parallel
    have = max(gpus, 1)  # no GPU (a CPU rehearsal): one device's worth
    if backend == "vllm":
        if dp > 1:
            raise ConfigError(
                f"data_parallel {dp} with the vllm backend: it runs one process over "
                'tensor_parallel_size GPUs; set data_parallel = 1 or backend = "hf"'
            )
        tp, dp = tp or have, 1
    else:
        tp, dp = 1, dp or have
    if tp * dp > have:
        raise ConfigError(
            f"layout {backend} tensor parallel {tp} x data parallel {dp} needs {tp * dp} GPUs, the "
            f"stage sees {gpus}; lower tensor_parallel_size/data_parallel in the hosts file"
        )
    return Layout(backend, tp, dp, reason)


def known(configured: Layout, args: StageArgs = StageArgs()) -> Layout | None:
    """The layout when nothing of it depends on the host (a dry run can show the exact argv), else None."""
    backend = args.backend or configured.backend
    if backend == "vllm":
        given = args.tensor_parallel_size or configured.tensor_parallel_size
    else:
        given = args.data_parallel or configured.data_parallel
    if backend not in BACKENDS or not given:
        return None
    return resolve(configured, gpus=given, image_has_vllm=backend == "vllm", args=args)


def stage_flags(layout: Layout, args: StageArgs = StageArgs()) -> tuple[str, ...]:
    """`pipeline extract` flags for a resolved layout, leaving out those the operator gave after `--` (their
    words stay in args.argv, which the stage gets as given)."""
    out: list[str] = []
    if args.backend is None:
        out += ["--backend", layout.backend]
    if layout.backend == "vllm" and args.tensor_parallel_size is None:
        out += ["--tensor-parallel-size", str(layout.tensor_parallel_size)]
    if layout.backend != "vllm" and args.data_parallel is None:
        out += ["--data-parallel", str(layout.data_parallel)]
    return tuple(out)


def describe(configured: Layout, resolved: Layout | None = None) -> str:
    """One line for --dry-run and the preflight table: the configured values and what auto becomes."""
    if resolved is not None:
        why = f" ({resolved.reason})" if resolved.reason else ""
        if resolved.backend == "vllm":
            return f"backend vllm, tensor parallel {resolved.tensor_parallel_size}, data parallel 1{why}"
        return f"backend hf, data parallel {resolved.data_parallel} (one process per GPU){why}"
    backend = (
        "auto (hf where the weights fit one GPU, vllm where they do not or their size is unknown; "
        "no vLLM in the image: hf)"
        if configured.backend == AUTO
        else configured.backend
    )
    tp = configured.tensor_parallel_size or "all GPUs"
    dp = configured.data_parallel or "1 with vllm, one process per GPU with hf"
    return f"backend {backend}, tensor parallel {tp}, data parallel {dp}; resolved by the preflight"
