"""Benchmark: the hf extraction loop against the naive way, side by side in one run.

Naive = one sample at a time, ``output_hidden_states=True`` (every layer kept on the device), the 4 chosen
layers copied to the host and ``torch.save``d per sample. Ours = ``pipeline extract``'s loop (length-bucketed
batches, forward hooks on 4 layers, no lm_head, background writers). Both write real files to --workdir.
Prints a markdown table and writes JSON with every figure, the decoder roofline (bench/roofline.py) among
them; exits non-zero when ours is further from an fp32 run of the checkpoint than the naive way.

    python -m bench.extract_bench --preset tiny            # CPU, tiny model
    python -m bench.extract_bench --preset llama-1b        # GPU, ~1B random Llama, seq 2048
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import click
import numpy as np
import torch

from bench.gpu_models import SHAPES
from bench.roofline import model_shape

PRESETS = {
    # name: (model overrides, samples, seq_length, naive samples)
    "tiny": (dict(), 96, 256, 32),
    "llama-1b": (SHAPES["llama-1b"], 256, 2048, 32),
}


def make_prepared(out: Path, n: int, seq_length: int, vocab: int, seed: int = 0) -> None:
    from pipeline.ondisk import formats

    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_length // 2, seq_length, size=n)  # 50%..100% of seq_length - 1
    rows = [(rng.integers(0, vocab, size=int(t)).tolist(), [1] * int(t)) for t in lengths]
    samples = formats.PreparedSamples.from_rows(rows)
    meta = formats.PreparedMetadata(
        model="bench",
        seq_length=seq_length,
        max_tokens=seq_length - 1,
        num_samples=n,
        num_tokens=int(samples.offsets[-1]),
        num_loss_tokens=int(samples.offsets[-1]),
        target_vocab_size=vocab,
        draft_vocab_size=None,
        source="random",
        mask_method="all",
    )
    formats.write_prepared(out, samples, meta)


def naive(
    model_dir: Path, prepared: Path, out: Path, n: int, layer_ids: list[int], device: str, dtype
) -> dict:
    from transformers import AutoModelForCausalLM

    from pipeline.ondisk import formats

    samples, _ = formats.read_prepared(prepared)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out.mkdir(parents=True, exist_ok=True)
    tokens = 0
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(n):
            ids = torch.as_tensor(samples.ids(i).astype(np.int64))
            hs = model(
                input_ids=ids[None].to(device), output_hidden_states=True, use_cache=False
            ).hidden_states
            keep = [hs[k + 1][0].cpu() for k in layer_ids]
            torch.save(
                {"input_ids": ids, "hidden_states": keep, "loss_mask": torch.ones_like(ids)},
                out / f"data_{i}.pt",
            )
            tokens += len(ids)
    _sync(device)
    elapsed = time.perf_counter() - t0
    del model
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_only(model_dir: Path, prepared: Path, layer_ids: list[int], max_batch_tokens: int) -> float:
    """tokens/s of the hooked forward alone (no host copy, no writes): the ceiling of the loop."""
    from pipeline.ondisk import formats
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.hf import HFBackend
    from pipeline.extract.plan import plan_batches
    from pipeline.model.modeldir import read_model_dir

    samples, _ = formats.read_prepared(prepared)
    backend = HFBackend(BackendOptions(model=read_model_dir(model_dir), layer_ids=tuple(layer_ids)))
    batches = plan_batches(samples.lengths(), max_batch_tokens, 64)
    backend.forward_layers([samples.ids(i).tolist() for i in batches[0].indices])
    _sync(str(backend.device))
    t0 = time.perf_counter()
    tokens = 0
    for b in batches:
        seqs = [samples.ids(i).tolist() for i in b.indices]
        backend.forward_layers(seqs)
        tokens += sum(map(len, seqs))
    _sync(str(backend.device))
    elapsed = time.perf_counter() - t0
    backend.close()
    return tokens / elapsed


def agreement(naive_dir: Path, ours_dir: Path, n: int, layer_ids: list[int]) -> float:
    """Worst relative error (per sample and layer, Frobenius) between the loop's files and the naive ones,
    over the layers the naive loop stores pre-norm (hidden_states[k+1] for k < L-1: the last layer comes
    normed)."""
    from pipeline.ondisk import formats

    worst = 0.0
    for i in range(n):
        a = formats.read_sample(formats.data_file(ours_dir, i))
        b = formats.read_sample(formats.data_file(naive_dir, i))
        if not torch.equal(a["input_ids"], b["input_ids"]):
            raise SystemExit(f"sample {i}: input_ids differ between the loop and the naive run")
        for j in range(len(layer_ids)):
            x, y = a["hidden_states"][j].float(), b["hidden_states"][j].float()
            worst = max(worst, float((x - y).norm() / y.norm()))
    return worst


def fp32_errors(
    model_dir: Path, prepared: Path, runs: dict[str, Path], layer_ids: list[int], n: int = 4
) -> dict:
    """Per layer stored pre-norm by both runs, each run's worst relative error over its first ``n`` samples
    against the checkpoint loaded in fp32 and run one sample at a time (bf16 runs that round differently
    drift apart through deep random layers: each is held to the exact answer, not to the other)."""
    from transformers import AutoModelForCausalLM

    from bench.hf_levers import layer_errors, one_by_one
    from pipeline.ondisk import formats

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    samples, _ = formats.read_prepared(prepared)
    reference = [
        states[: len(layer_ids)] for states in one_by_one(model, [samples.ids(i).tolist() for i in range(n)])
    ]
    del model
    return {
        who: layer_errors(
            [
                formats.read_sample(formats.data_file(d, i))["hidden_states"][: len(layer_ids)]
                for i in range(n)
            ],
            reference,
        )
        for who, d in runs.items()
    }


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path("/tmp/extract-bench"), show_default=True
)
@click.option("--samples", type=int, default=None, help="Override the preset's sample count.")
@click.option("--max-batch-tokens", type=int, default=None)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(
    preset: str, workdir: Path, samples: int | None, max_batch_tokens: int | None, json_out: Path | None
) -> None:
    from pipeline.ondisk import formats
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.stage import run
    from pipeline.demo.tiny import build_tiny_model

    overrides, n, seq_length, n_naive = PRESETS[preset]
    n = samples or n
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    model_dir = build_tiny_model("llama", workdir / "model", **overrides)
    cfg = json.loads((model_dir / "config.json").read_text())
    L, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    layer_ids = [2, L // 2, L - 3, L - 1]
    make_prepared(workdir / "prepared", n, seq_length, vocab)
    mbt = max_batch_tokens or (32768 if device == "cuda" else 4096)

    # warm-up (kernels, allocator, page cache for the model file), not timed
    run(
        ExtractConfig(
            prepared=workdir / "prepared",
            model=model_dir,
            out=workdir / "warm",
            limit=min(8, n),
            max_batch_tokens=mbt,
            verify=False,
            progress=False,
        )
    )
    base = naive(
        model_dir, workdir / "prepared", workdir / "naive", min(n_naive, n), layer_ids, device, dtype
    )
    ours = run(
        ExtractConfig(
            prepared=workdir / "prepared",
            model=model_dir,
            out=workdir / "ours",
            max_batch_tokens=mbt,
            verify=False,
            progress=False,
        )
    )
    fwd = forward_only(model_dir, workdir / "prepared", layer_ids, mbt)
    roof = model_shape(model_dir)
    lengths = [int(t) for t in formats.read_prepared(workdir / "prepared")[0].lengths()]
    worst = agreement(workdir / "naive", workdir / "ours", min(n_naive, n), layer_ids[:-1])
    errors = fp32_errors(
        model_dir,
        workdir / "prepared",
        {"ours": workdir / "ours", "naive": workdir / "naive"},
        layer_ids[:-1],
    )
    result = {
        "preset": preset,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "samples": n,
        "seq_length": seq_length,
        "max_batch_tokens": mbt,
        "naive_tokens_per_s": base["tokens_per_s"],
        "ours_tokens_per_s": ours["tokens_per_s"],
        "speedup": ours["tokens_per_s"] / base["tokens_per_s"],
        "ours_capture_seconds": ours["capture_seconds"],
        "ours_seconds": ours["seconds"],
        "written_bytes": ours["bytes"],
        "ours_device_idle_fraction": ours.get("device_idle_fraction"),
        "write_bandwidth_gb_s": ours["bytes"] / ours["seconds"] / 1e9,
        "decoder_params": roof.decoder_params,
        "forward_only_tokens_per_s": fwd,
        "max_rel_err_vs_naive": worst,
        "rel_err_vs_fp32_per_layer": errors,
    }
    if device == "cuda":  # decoder FLOPs (bench/roofline.py) over the bf16 peak
        result["roofline_fraction"] = roof.roofline_fraction(lengths, ours["seconds"])
        # the device's rate while its compute stream is busy (CUDA events around each forward; the copies
        # run on a second stream and are not counted)
        result["roofline_fraction_device_busy"] = roof.roofline_fraction(lengths, ours["device_busy_seconds"])
        result["roofline_fraction_forward_only"] = roof.roofline_fraction(lengths, sum(lengths) / fwd)
    print(json.dumps(result, indent=2))
    print(
        f"\n| preset | device | naive tok/s | ours tok/s | speedup |\n|---|---|---|---|---|\n"
        f"| {preset} | {result['device']} | {base['tokens_per_s']:,.0f} | {ours['tokens_per_s']:,.0f} | "
        f"{result['speedup']:.2f}x |"
    )
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    # ours may be no less exact than the naive loop, layer by layer (a slack of a quarter plus 5e-3)
    if any(o > 1.25 * b + 5e-3 for o, b in zip(errors["ours"], errors["naive"], strict=True)):
        raise SystemExit(
            f"ours is further from fp32 than the naive loop: {errors} (a wrong capture is not a speed-up)"
        )


if __name__ == "__main__":
    main()
