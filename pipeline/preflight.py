"""``pipeline preflight``: every check that can run before a model load, in seconds.

Owns the checks of an extraction's inputs and environment against the known breaks: the model directory
(config, wrapper text_config, layer count and embedding shape against the checkpoint's safetensors headers,
MoE routing keys, layer ids), the tokenizer and its chat template, the prepared data and vocab files, the
visible devices against the tensor parallel size, free disk for the output, and, for the vllm backend, the
installed vLLM (DESIGN.md section 10): a version with native extraction and a patch set of ours (asked of
patches/apply.py, which owns the sets and their markers), applied and current; the speculative method, the
hidden-states connector and its file format, the settings extraction forces; and what this vLLM can do for
THIS target (EAGLE-3 aux capture for its architecture, the final layer on the DeepSeek family, a connector
that is safe at this tensor parallel size). It never reads a weight: safetensors files are opened for their
JSON headers only, and vLLM's model classes are imported, never built.

Checks return CheckResult values (pipeline/checks.py) in two groups: first those that read files and
package metadata only (the stage's command line when STAGE ARGS are given, via pipeline/argcheck.py; config,
checkpoint headers, prepared data, free disk, vLLM's version and patch set), then those that import
transformers, torch or vLLM (tokenizer, chat template, devices, vLLM's APIs and model classes), which a
fail-fast run skips once a file check has refused it. Only ``command`` turns them into output lines and an
exit code. The ops preflight runs this command, once, in the stage's image (ops/stage.py preflight_script).

The checks of the installed vLLM that need no model (pipeline/runtime/vllm_checks.py) and the checkpoint's
headers and MoE routing keys (pipeline/model/checkpoint.py) live below the stages, where the vllm backend
checks by them too.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.ondisk.paths import LoopCheckedPath

from contract import sizes
from contract.experts import experts_met
from pipeline.checks import CheckResult, fail, ok, warn
from pipeline.errors import CheckFailed, StageError
from pipeline.model.experts import expert_parallel_refusal
from pipeline.model import quantization
from pipeline.model.layers import default_layer_ids, parse_layer_ids, validate_layer_ids
from pipeline.model import modeldir
from pipeline.model.modeldir import ModelDir, read_model_dir
from pipeline.model.checkpoint import check_moe_routing, checkpoint_tensor_names, safetensors_header
from pipeline.runtime.vllm_checks import (
    CONNECTOR,
    SINCE,
    check_apis,
    check_vllm_version,
    dotted,
    import_modules,
    installed_version,
    source,
    version_tuple,
    vllm_new_enough,
)

# Targets whose decoder is vLLM's DeepseekV2Model (Kimi-K2.5's text model is a DeepseekV3).
DEEPSEEK_FAMILY = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekForCausalLM",
    "KimiK25ForConditionalGeneration",
    "KimiVLForConditionalGeneration",
)
EMBED_SUFFIX = "embed_tokens.weight"


@dataclass(frozen=True)
class PreflightConfig:
    """What an extraction run is about to use."""

    model: Path  # target model directory
    prepared: Path | None = None  # output of `pipeline prepare` (vocab files, token counts)
    out: Path | None = None  # hidden-states directory to be written (free disk, stray .pt files)
    backend: str = "vllm"  # vllm: also check the installed vLLM
    layer_ids: tuple[int, ...] | None = None  # default [2, L//2, L-3, L-1]
    tensor_parallel_size: int | None = None  # default: all visible devices
    dtype: str = "auto"  # for the disk estimate: auto counts as bfloat16
    trust_remote_code: bool = False
    expert_parallel: bool = False  # extract's --expert-parallel: the vllm backend, an MoE target


# ------------------------------------------------------------------ model checks


def check_model(cfg: PreflightConfig) -> Iterator[CheckResult]:
    """The model's checks that read files only: config, checkpoint headers, layer ids, prepared data and
    vocab files (numpy), free disk for the output."""
    try:
        model = read_model_dir(cfg.model)
    except StageError as exc:
        yield fail("model config", str(exc))
        return
    text = model.raw.get("text_config") or model.raw
    if not model.architecture:
        yield fail(
            "model config",
            f"{cfg.model}/config.json has no `architectures`: vLLM cannot choose a model class",
        )
        return
    wrapper = (
        f", wrapper (decoder config under text_config, model_type {model.model_type})"
        if model.is_wrapper
        else ""
    )
    yield ok(
        "model config",
        f"{model.architecture}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"vocab {model.vocab_size}{wrapper}",
    )
    if model.architecture.startswith("KimiK25") and not model.is_wrapper:
        yield fail("model config", f"{model.architecture} needs a text_config section in config.json")
    yield from check_checkpoint(cfg.model, model, text)
    for status, detail in quantization.quantization_checks(cfg.backend, model.raw):
        yield (ok if status == "ok" else fail)("quantization", detail)
    if cfg.expert_parallel:
        refusal = expert_parallel_refusal(cfg.backend, cfg.model, model.raw)
        k, experts = experts_met(model.raw)
        if refusal:
            yield fail("expert parallel", refusal)
        else:
            yield ok("expert parallel", f"{experts} routed experts ({k} per token) spread over the GPUs")
    yield from check_layer_ids(cfg, model)
    if cfg.prepared is not None:
        yield from check_prepared(cfg.prepared, model)
    yield from check_disk(cfg, model)


def readable_model(cfg: PreflightConfig) -> ModelDir | None:
    """The model directory when its config reads (None: check_model said why)."""
    try:
        return read_model_dir(cfg.model)
    except StageError:
        return None


def check_model_imports(cfg: PreflightConfig, model: ModelDir) -> Iterator[CheckResult]:
    """The model's checks that import packages: the tokenizer and its chat template (transformers, which
    imports torch) and, for vLLM, the devices and tensor parallel size (torch)."""
    yield from check_tokenizer(cfg, model)
    yield from check_parallel(cfg, model, model.raw.get("text_config") or model.raw)


def check_checkpoint(model_dir: Path, model: ModelDir, text: dict) -> Iterator[CheckResult]:
    try:
        names, source = checkpoint_tensor_names(model_dir)
    except (StageError, OSError, json.JSONDecodeError, KeyError) as exc:
        yield fail("checkpoint", f"cannot read tensor names: {exc}")
        return
    try:  # the stages' own rule (pipeline/model/modeldir.py): one owner of config vs checkpoint
        modeldir.check_layers(model, list(names))
    except StageError as exc:
        yield fail("layer count", str(exc))
    else:
        yield ok(
            "layer count",
            f"{model.num_layers} decoder layers in config.json and in the checkpoint ({source})",
        )
    if model.tie_word_embeddings:
        try:
            modeldir.check_tied_head(model, names)
        except (StageError, OSError) as exc:
            yield fail("tied embeddings", str(exc))
    embeds = [n for n in names if n.endswith(EMBED_SUFFIX) and "layers." not in n]
    if not embeds:
        yield fail("embedding", f"no *{EMBED_SUFFIX} in the checkpoint ({source})")
    else:
        shard = model_dir / names[embeds[0]]
        try:
            shape = safetensors_header(shard)[embeds[0]]["shape"]
        except (StageError, OSError, KeyError, json.JSONDecodeError) as exc:
            yield fail("embedding", f"cannot read the header of {shard}: {exc}")
        else:
            if list(shape) != [model.vocab_size, model.hidden_size]:
                yield fail(
                    "embedding",
                    f"{embeds[0]} has shape {shape} but config.json says "
                    f"vocab_size {model.vocab_size}, hidden_size "
                    f"{model.hidden_size}: config and weights do not belong together",
                )
            else:
                yield ok("embedding", f"{embeds[0]} {shape} matches config.json")
    yield from check_moe_routing(names, text)


def check_layer_ids(cfg: PreflightConfig, model: ModelDir) -> Iterator[CheckResult]:
    try:
        ids = validate_layer_ids(list(cfg.layer_ids) if cfg.layer_ids else None, model.num_layers)
    except StageError as exc:
        yield fail("layer ids", str(exc))
        return
    yield ok("layer ids", f"{ids} of {model.num_layers} (vLLM aux ids {[k + 1 for k in ids]})")


def check_tokenizer(cfg: PreflightConfig, model: ModelDir) -> Iterator[CheckResult]:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any load failure is the finding
        hint = (
            " (pass --trust-remote-code if the tokenizer is custom code)" if not cfg.trust_remote_code else ""
        )
        yield fail(
            "tokenizer", f"cannot load the tokenizer of {cfg.model}: {str(exc).splitlines()[0][:200]}{hint}"
        )
        return
    size = len(tok)
    if size > model.vocab_size:
        yield fail(
            "tokenizer",
            f"tokenizer has {size} tokens but the model's vocab_size is {model.vocab_size}: wrong tokenizer",
        )
    else:
        yield ok("tokenizer", f"{type(tok).__name__}, {size} tokens <= vocab_size {model.vocab_size}")
    if not getattr(tok, "chat_template", None):
        yield fail(
            "chat template",
            f"the tokenizer of {cfg.model} has no chat_template: prepare cannot build loss masks",
        )
        return
    try:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "preflight"}, {"role": "assistant", "content": "ok"}], tokenize=True
        )
    except Exception as exc:  # noqa: BLE001
        yield fail(
            "chat template",
            f"the chat template does not render a user/assistant turn: {str(exc).splitlines()[0][:200]}",
        )
        return
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
    if not ids or max(ids) >= model.vocab_size:
        yield fail("chat template", f"rendered ids out of range for vocab {model.vocab_size}: {ids[:8]}")
    else:
        yield ok("chat template", f"renders a turn into {len(ids)} tokens")


def check_prepared(prepared: Path, model: ModelDir) -> Iterator[CheckResult]:
    from pipeline.ondisk import formats  # imports torch: only once the config-level checks have printed

    try:
        samples, meta = formats.read_prepared(prepared)
    except (StageError, OSError, ValueError) as exc:
        yield fail("prepared data", str(exc))
        return
    if meta.target_vocab_size != model.vocab_size:
        yield fail(
            "prepared data",
            f"{prepared} was prepared for a vocab of {meta.target_vocab_size}, "
            f"the model has {model.vocab_size}: "
            "re-run prepare with this model's tokenizer",
        )
    else:
        top = int(samples.tokens.max()) if len(samples.tokens) else -1
        if top >= model.vocab_size:
            yield fail(
                "prepared data",
                f"token id {top} in {prepared}/tokens.npy is outside the vocab of {model.vocab_size}",
            )
        else:
            yield ok(
                "prepared data",
                f"{len(samples)} samples, {int(samples.offsets[-1])} tokens, seq_length {meta.seq_length}",
            )
    have_d2t, have_t2d = (prepared / formats.D2T).is_file(), (prepared / formats.T2D).is_file()
    if not (have_d2t or have_t2d):
        yield warn(
            "vocab files",
            f"no {formats.D2T}/{formats.T2D} in {prepared} "
            "(needed for training: prepare --draft-vocab-size N)",
        )
        return
    try:
        d2t, t2d = formats.read_vocab(prepared)
    except (StageError, OSError, ValueError) as exc:
        yield fail("vocab files", str(exc))
        return
    problems = []
    if t2d.ndim != 1 or len(t2d) != model.vocab_size:
        problems.append(f"{formats.T2D} has {len(t2d)} entries, the model's vocab_size is {model.vocab_size}")
    if d2t.ndim != 1 or int(t2d.sum()) != len(d2t):
        problems.append(f"{formats.D2T} has {len(d2t)} entries but {formats.T2D} selects {int(t2d.sum())}")
    elif len(t2d) == model.vocab_size:
        import numpy as np

        targets = np.arange(len(d2t)) + d2t
        if targets.min() < 0 or targets.max() >= model.vocab_size or not t2d[targets].all():
            problems.append(f"{formats.D2T} maps draft ids to target ids that {formats.T2D} does not select")
    if problems:
        yield fail("vocab files", "; ".join(problems) + ": re-run prepare --overwrite with this model")
    else:
        yield ok("vocab files", f"draft vocab {len(d2t)} of target vocab {len(t2d)}, d2t/t2d consistent")


def cuda_usable(devices: int) -> CheckResult:
    """GPUs that NVML lists are usable by this torch: a driver older than torch's CUDA (vLLM 0.32's PyPI
    build is CUDA 13.0: driver >= 580) lists the GPUs and then fails every CUDA call, after the server was
    stopped."""
    import torch

    if torch.cuda.is_available():
        return ok("cuda", f"{devices} GPU(s), torch {torch.__version__} (CUDA {torch.version.cuda})")
    return fail(
        "cuda",
        f"{devices} GPU(s) listed by NVML but torch {torch.__version__} (CUDA {torch.version.cuda}) "
        "cannot use them: the NVIDIA driver is older than this CUDA build (CUDA 13.x needs a driver "
        ">= 580); update the driver or use an image built for the driver's CUDA",
    )


def check_parallel(cfg: PreflightConfig, model: ModelDir, text: dict) -> Iterator[CheckResult]:
    if cfg.backend != "vllm":
        return
    from pipeline.backends.base import visible_device_count

    devices = visible_device_count()
    if devices:
        yield cuda_usable(devices)
    if cfg.expert_parallel and (refusal := expert_parallel_refusal("vllm", on_gpu=devices > 0)):
        yield fail("expert parallel", refusal)
    tp = cfg.tensor_parallel_size or max(1, devices)
    heads = int(text.get("num_attention_heads", 0) or 0)
    kv_heads = int(text.get("num_key_value_heads", heads) or heads)
    problems = []
    if devices and tp > devices:
        problems.append(f"tensor parallel size {tp} > {devices} visible GPU(s)")
    if not devices and tp > (os.cpu_count() or 1):
        problems.append(
            f"tensor parallel size {tp} > {os.cpu_count()} CPU cores (no GPU visible: vLLM CPU backend)"
        )
    if heads and heads % tp:
        problems.append(f"num_attention_heads {heads} is not divisible by tensor parallel size {tp}")
    if kv_heads and not (kv_heads % tp == 0 or tp % kv_heads == 0):
        problems.append(
            f"num_key_value_heads {kv_heads} and tensor parallel size {tp} do not divide each other"
        )
    where = f"{devices} visible GPU(s)" if devices else "no GPU visible (vLLM CPU backend)"
    if problems:
        yield fail("tensor parallel", "; ".join(problems))
    else:
        yield ok("tensor parallel", f"size {tp}, {where}")


def check_disk(cfg: PreflightConfig, model: ModelDir) -> Iterator[CheckResult]:
    if cfg.out is None:
        return
    from pipeline.ondisk import formats

    out = cfg.out
    stray = (
        sorted(p.name for p in out.glob("*pt") if not formats.DATA_FILE_RE.match(p.name))
        if out.is_dir()
        else []
    )
    if stray:
        yield fail(
            "output dir",
            f"{out} holds {stray[:3]}: speculators loads every file ending in 'pt' there; move them out",
        )
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if cfg.prepared is None or not formats.is_prepared_dir(cfg.prepared):
        yield warn(
            "free disk",
            f"{free / 2**30:.1f} GiB free at {probe}; pass --prepared to compare with the expected size",
        )
        return
    meta = json.loads((cfg.prepared / "metadata.json").read_text())
    dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    need = sizes.hidden_states_bytes(
        int(meta["num_tokens"]), int(meta["num_samples"]), model.hidden_size, dtype
    )
    detail = (
        f"{need / 2**30:.2f} GiB expected "
        f"({meta['num_tokens']} tokens x 4 layers x {model.hidden_size} x {dtype}), "
        f"{free / 2**30:.1f} GiB free at {probe}"
    )
    yield (ok if free >= need * 1.05 else fail)("free disk", detail)


# ------------------------------------------------------------------ installed vLLM


def check_target(cfg: PreflightConfig, model: ModelDir, modules: dict) -> Iterator[CheckResult]:
    """What the installed vLLM can capture for THIS model: an architecture with EAGLE-3 aux capture, the
    final layer on the DeepSeek family, and a connector that is safe under this tensor parallel size."""
    arch = model.architecture
    version = version_tuple((installed_version("vllm") or ("", "0"))[1])
    try:
        cls = modules["registry"].ModelRegistry._try_load_model_cls(arch)
    except KeyError:
        return
    except Exception as exc:  # noqa: BLE001
        yield fail(
            "eagle-3 capture", f"vLLM cannot load the model class of {arch}: {str(exc).splitlines()[0][:200]}"
        )
        return
    if cls is None:
        yield fail("eagle-3 capture", f"{arch} is not a model architecture the installed vLLM knows")
        return
    if not modules["interfaces"].supports_eagle3(cls):
        yield fail(
            "eagle-3 capture",
            f"vLLM's {cls.__name__} does not implement SupportsEagle3: it cannot capture "
            "intermediate layers for this target",
        )
        return
    yield ok("eagle-3 capture", f"{cls.__name__} implements SupportsEagle3")
    if arch in DEEPSEEK_FAMILY:
        forward = source(modules["deepseek"].DeepseekV2Model.forward)
        if (
            version < SINCE["deepseek final layer"]
            or "self.end_layer in self.aux_hidden_state_layers" not in forward
        ):
            yield fail(
                "final-layer capture",
                f"this vLLM's DeepseekV2Model never captures the last layer's output "
                f"(silently one state short; fixed in {dotted(SINCE['deepseek final layer'])})",
            )
        else:
            yield ok(
                "final-layer capture",
                "DeepseekV2Model captures the last layer's output (vLLM id num_hidden_layers)",
            )
    tp = cfg.tensor_parallel_size or 1
    if tp > 1:
        connector = modules["connector"].ExampleHiddenStatesConnector
        if version < SINCE["tp-safe connector"] or "get_finished_count" not in vars(connector):
            yield fail(
                "tensor-parallel connector",
                f"this vLLM's {CONNECTOR} waits for every TP rank's write and hangs at "
                f"tensor parallel {tp} (fixed in {dotted(SINCE['tp-safe connector'])})",
            )
        else:
            yield ok(
                "tensor-parallel connector",
                f"{CONNECTOR} reports one write per request at tensor parallel {tp}",
            )


def check_quantized_kernels(model: ModelDir) -> Iterator[CheckResult]:
    """A quantized MoE target: whether this vLLM has a kernel for its experts here (pipeline/model/
    quantization.py asks vLLM's own kernel classes)."""
    quant = quantization.read_quantization(model.raw)
    if quant is None:
        return
    refusal = quantization.vllm_refusal(model.raw, quant, experts_met(model.raw)[1])
    if refusal:
        yield fail("quantized kernels", refusal)
    elif quant.weight_only_int and experts_met(model.raw)[1]:
        yield ok(
            "quantized kernels", "a WNA16 MoE: vLLM picks its kernel at engine start (GPU: not checked here)"
        )


def file_checks(cfg: PreflightConfig, stage_args: tuple[str, ...] = ()) -> Iterator[CheckResult]:
    """The checks that read files and package metadata only (no torch, transformers or vLLM import): the
    stage's command line (``pipeline check-args``) when given, the model's files, the prepared data, free
    disk, and for vLLM its installed version and patch set."""
    if stage_args:
        from pipeline.argcheck import stage_args_check

        yield stage_args_check(stage_args[0], tuple(stage_args[1:]))
    if cfg.backend not in ("vllm", "hf"):
        yield fail("backend", f"unknown backend {cfg.backend!r}: choose vllm or hf")
        return
    yield from check_model(cfg)
    if cfg.backend == "vllm":
        yield from check_vllm_version()


def import_checks(cfg: PreflightConfig) -> Iterator[CheckResult]:
    """The checks that import transformers, torch or vLLM: tokenizer, chat template, devices and tensor
    parallel size, the installed vLLM's APIs and what it can capture for this target."""
    if cfg.backend not in ("vllm", "hf"):
        return
    model = readable_model(cfg)
    if model is not None and model.architecture:  # without one, check_model stopped at `model config`
        yield from check_model_imports(cfg, model)
    if cfg.backend == "vllm" and vllm_new_enough():
        modules, failures = import_modules()
        yield from failures
        yield from check_apis(modules)
        if model is not None:
            yield from check_target(cfg, model, modules)
            yield from check_quantized_kernels(model)


def skipped_names(cfg: PreflightConfig) -> list[str]:
    """What import_checks would have checked, by name (for the line that says they were skipped)."""
    names = ["tokenizer", "chat template"]
    if cfg.backend == "vllm":
        names += ["cuda", "tensor parallel", "vllm imports and APIs", "eagle-3 capture", "quantized kernels"]
    return names


ANY = "any"  # fail_fast_on: a failure of any check


def run_checks(
    cfg: PreflightConfig, stage_args: tuple[str, ...] = (), fail_fast_on: Collection[str] = ()
) -> Iterator[CheckResult]:
    """Every check as results (never raises for a failed check): first those that read files only, then
    those that import transformers, torch or vLLM. ``stage_args`` (STAGE ARGS...): also check that
    ``pipeline STAGE ARGS`` would accept its command line, first. ``fail_fast_on`` (check names, or ANY):
    once one of these file checks has failed, the import checks are not run (one ``skipped`` warning names
    them): the run is refused either way, and its refusal then costs no torch import. A caller that
    tolerates some failures (ops demotes the checkpoint's for prepare) names only the ones it refuses on."""
    first = None
    for result in file_checks(cfg, stage_args):
        if first is None and result.failed and (ANY in fail_fast_on or result.name in fail_fast_on):
            first = result.name
        yield result
    if first is not None:
        yield warn("skipped", f"{', '.join(skipped_names(cfg))}: not checked, `{first}` failed (fail fast)")
        return
    yield from import_checks(cfg)


# ------------------------------------------------------------------ CLI


def _write_json(path: Path, results: list[CheckResult], seconds: float) -> None:
    from dataclasses import asdict

    from pipeline.ondisk.atomic import write_json

    write_json(
        path,
        {
            "ok": not any(r.failed for r in results),
            "seconds": round(seconds, 3),
            "checks": [asdict(r) for r in results],
        },
    )


# the stage's arguments (STAGE ARGS) begin at the first word that is no option of preflight's: theirs are
# never read as preflight's own (extract's --model, --prepared and --out are both)
@click.command("preflight", context_settings={"allow_interspersed_args": False})
@click.option("--model", type=LoopCheckedPath(), required=True, help="Target model directory.")
@click.option("--prepared", type=LoopCheckedPath(), default=None, help="Output of `pipeline prepare`.")
@click.option(
    "--out", type=LoopCheckedPath(), default=None, help="Hidden-states directory the run will write."
)
@click.option("--backend", type=click.Choice(["vllm", "hf"]), default="vllm", show_default=True)
@click.option("--layer-ids", default=None, help="Comma-separated decoder layer ids (default 2,L//2,L-3,L-1).")
@click.option("--tensor-parallel-size", type=int, default=None, help="Default: all visible devices.")
@click.option(
    "--dtype", default="auto", show_default=True, help="For the disk estimate (auto counts as bfloat16)."
)
@click.option(
    "--trust-remote-code", is_flag=True, help="Allow the tokenizer's own Python code (e.g. Kimi-K2.5)."
)
@click.option("--expert-parallel", is_flag=True, help="extract's --expert-parallel (an MoE target on vllm).")
@click.option(
    "--json", "json_path", type=LoopCheckedPath(), default=None, help="Also write the results here."
)
@click.option(
    "--fail-fast-on",
    "fail_fast_on",
    default="",
    metavar="CHECKS",
    help=f"Comma-separated check names, or `{ANY}`: once one of them has failed, skip the checks that import "
    "transformers, torch or vLLM (tokenizer, chat template, devices, vLLM APIs).",
)
@click.argument("stage_args", nargs=-1, type=click.UNPROCESSED, metavar="[STAGE ARGS]...")
def command(
    layer_ids: str | None, json_path: Path | None, fail_fast_on: str, stage_args: tuple[str, ...], **kwargs
) -> None:
    """Check model, data, devices, disk and the installed vLLM before any model load.

    STAGE ARGS (after the options, or after `--`): first check that `pipeline STAGE ARGS` would accept its
    command line, as `pipeline check-args` does, in the same process."""
    t0 = time.perf_counter()
    ids = parse_layer_ids(layer_ids)
    cfg = PreflightConfig(layer_ids=tuple(ids) if ids else None, **kwargs)
    results = []
    names = tuple(n.strip() for n in fail_fast_on.split(",") if n.strip())
    for result in run_checks(cfg, stage_args, names):
        results.append(result)
        color = {"ok": "green", "warn": "yellow", "fail": "red"}[result.status]
        status = click.style(f"{result.status:<4}", fg=color, bold=result.failed)
        click.echo(f"[{time.perf_counter() - t0:6.2f}s] {status} {result.name}: {result.detail}")
    seconds = time.perf_counter() - t0
    if json_path is not None:
        _write_json(json_path, results, seconds)
    failed = [r.name for r in results if r.failed]
    if failed:
        raise CheckFailed(
            f"preflight: {len(failed)} check(s) failed in {seconds:.1f}s: {', '.join(dict.fromkeys(failed))}"
        )
    click.echo(f"preflight: all {len(results)} checks passed in {seconds:.1f}s")


__all__ = ["PreflightConfig", "command", "default_layer_ids", "run_checks"]
