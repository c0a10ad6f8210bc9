"""Benchmark: the target's load onto its device, the hf backend's way against transformers' ``device_map``,
each in a fresh process, in turns.

- ``host`` (the product): ``pipeline.backends.hf.load_causal_lm`` as extract runs it: ``from_pretrained`` into
  host memory, then ``.to(device)``; on a GPU ``init_cuda`` first, as ``HFBackend`` does.
- ``device_map``: ``from_pretrained(..., device_map={"": device})``, transformers putting each tensor on the
  device as it reads it (after the same ``init_cuda``). transformers 5.19 refuses it without ``accelerate``
  (``check_and_set_device_map``), although for one device nothing of accelerate's runs; our image has none,
  so ``--accelerate-path DIR`` (``pip install --no-deps --target DIR accelerate``) goes on those runs'
  ``PYTHONPATH`` only, and without it the way is reported as refused.

Each process reports its parts (torch's import, CUDA init, transformers' import, the read, the move; a part a
way does not have is absent) and, in each way's first run, a sha256 of every parameter's bytes: the two ways
must load the same weights, bit for bit, or the bench exits non-zero. The target is one of
bench/gpu_models.py's shapes, built once under ``--workdir`` on ``--device`` and saved in ``--dtype``.

    python -m bench.load_bench --shape llama-1b --device cpu --repeat 5 --workdir /tmp/load-bench \\
        --accelerate-path /tmp/accel
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import click

from bench.timing import timed

REPO = Path(__file__).resolve().parent.parent
WAYS = ("host", "device_map")
PARTS = (
    "torch_import_seconds",
    "cuda_init_seconds",
    "transformers_import_seconds",
    "model_read_seconds",
    "model_to_device_seconds",
    "load_seconds",
)


def weights_digest(model) -> str:
    """sha256 of every parameter's and buffer's bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_once(way: str, model_dir: Path, device: str, dtype: str) -> tuple[object, dict[str, float]]:
    """One load in this process (the child's work): the model on ``device``, and its parts' seconds."""
    t0 = time.perf_counter()
    import torch

    figures = {"torch_import_seconds": time.perf_counter() - t0}
    from pipeline.backends.base import BackendOptions, resolve_dtype, timed_part
    from pipeline.backends.hf import init_cuda, load_causal_lm
    from pipeline.model.modeldir import read_model_dir

    dev = torch.device(device)
    if dev.type == "cuda":
        with timed_part(figures, "cuda_init_seconds"):
            init_cuda(dev)
    dt = resolve_dtype(dtype, dev)
    if way == "host":
        options = BackendOptions(model=read_model_dir(model_dir), layer_ids=(0,))
        model = load_causal_lm(options, dev, dt, figures)
    else:
        with timed_part(figures, "transformers_import_seconds"):
            from transformers import AutoModelForCausalLM
        with timed_part(figures, "model_read_seconds"):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, device_map={"": dev})
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    figures["load_seconds"] = time.perf_counter() - t0
    return model, figures


def run_child(
    way: str, model_dir: Path, device: str, dtype: str, digest: bool, accelerate: Path | None
) -> dict:
    """One load in a fresh process, timed from outside: its figures (``wall_seconds`` the whole process), or
    ``error`` with its last line."""
    path = [str(REPO)] + ([str(accelerate)] if accelerate is not None and way == "device_map" else [])
    path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    argv = [sys.executable, "-m", "bench.load_bench", "--child", way, "--model-dir", str(model_dir)]
    argv += ["--device", device, "--dtype", dtype] + (["--digest"] if digest else [])
    run = timed(argv, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}, cwd=REPO)
    last = run.lines[-1][1] if run.lines else ""
    if run.returncode != 0:
        return {"error": last[:300]}
    return {**json.loads(last), "wall_seconds": run.wall}


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per way, the median of each part over its runs that loaded (a part no run had is left out)."""
    medians = {}
    for way, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        medians[way] = {
            k: statistics.median(r[k] for r in ok) for k in (*PARTS, "wall_seconds") if ok and k in ok[0]
        }
    return medians


def ensure_model(workdir: Path, shape: str, device: str, dtype: str) -> Path:
    """bench/gpu_models.py's ``shape``, built on ``device`` and saved in ``dtype`` under ``workdir`` once."""
    import torch

    from bench.gpu_models import build_model, save_model

    out = workdir / f"{shape}-{dtype}"
    if not (out / "config.json").exists():
        model = build_model(shape, device).to(getattr(torch, dtype))
        save_model(model, out)
        del model
    return out


@click.command()
@click.option("--shape", default="llama-1b", show_default=True, help="bench/gpu_models.py's SHAPES.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="Runs per way.")
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path("/tmp/load-bench"), show_default=True
)
@click.option(
    "--accelerate-path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A folder with accelerate in it, for the device_map runs only.",
)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
@click.option("--child", type=click.Choice(WAYS), default=None, hidden=True)
@click.option("--model-dir", type=click.Path(path_type=Path), default=None, hidden=True)
@click.option("--digest", is_flag=True, hidden=True)
def main(
    shape: str,
    device: str,
    dtype: str,
    repeat: int,
    workdir: Path,
    accelerate_path: Path | None,
    json_out: Path | None,
    child: str | None,
    model_dir: Path | None,
    digest: bool,
) -> None:
    if child is not None:
        try:
            model, figures = load_once(child, model_dir, device, dtype)
        except Exception as exc:  # noqa: BLE001 - a way that cannot load is reported in one line
            raise SystemExit(
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        if digest:
            figures["digest"] = weights_digest(model)
        print(json.dumps(figures), flush=True)
        return
    t0 = time.perf_counter()
    model_dir = ensure_model(workdir, shape, device, dtype)
    print(f"model {model_dir} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for i in range(repeat):
        for way in WAYS:  # in turns: both ways see the same machine load and page cache
            r = run_child(way, model_dir, device, dtype, digest=i == 0, accelerate=accelerate_path)
            runs[way].append(r)
            print(json.dumps({"way": way, "run": i, **r}), flush=True)
    med = summarize(runs)
    digests = {way: rs[0].get("digest") for way, rs in runs.items()}
    same = None if None in digests.values() else len(set(digests.values())) == 1
    ratio = (
        med["host"]["load_seconds"] / med["device_map"]["load_seconds"]
        if med["host"] and med["device_map"]
        else None
    )
    print("\n| way | " + " | ".join(k.removesuffix("_seconds") for k in (*PARTS, "wall_seconds")) + " |")
    print("|---|" + "---:|" * (len(PARTS) + 1))
    for way, m in med.items():
        print(
            f"| {way} | "
            + " | ".join(f"{m[k]:.2f}" if k in m else "-" for k in (*PARTS, "wall_seconds"))
            + " |"
        )
    print(
        f"\nload (torch import to weights on {device}), median of {repeat}: host / device_map = "
        + (f"{ratio:.2f}x" if ratio else "n/a (a way did not load)")
        + f"; weights bit-identical: {same}"
    )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(
            json.dumps(
                {
                    "shape": shape,
                    "device": device,
                    "dtype": dtype,
                    "repeat": repeat,
                    "runs": runs,
                    "medians": med,
                    "host_over_device_map": ratio,
                    "bit_identical": same,
                },
                indent=2,
            )
        )
    if same is False:
        raise SystemExit("the two ways loaded different weights")


if __name__ == "__main__":
    main()
