"""Benchmark: how soon `pipeline preflight` names a misconfiguration, next to how long `extract --backend
vllm` on the same inputs takes to reach its model load (and what it does after).

For each misconfigured copy of a tiny model (or of its prepared data), both commands run as subprocesses
from a cold start; every output line is timestamped from process start. Reported per case: preflight's
time to its first `fail` line and to exit, and extract's time to vLLM's "Starting to load model" line,
to exit, its exit code and how it ended. Needs the vLLM environment (.venv-vllm).

    .venv-vllm/bin/python bench/preflight_bench.py --workdir /tmp/pfb --json-out runs/preflight_bench.json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import numpy as np

LOAD_MARK = "Starting to load model"


def timed_run(argv: list[str], marks: dict[str, str], timeout: float) -> dict:
    """Run argv; return seconds from start to the first line containing each mark, to exit, and the rc."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    seen: dict[str, float] = {}
    tail: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            now = time.perf_counter() - t0
            for name, mark in marks.items():
                if name not in seen and mark in line:
                    seen[name] = now
            tail.append(line.rstrip())
            del tail[:-40]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc = proc.wait()
    reader.join(timeout=10)
    errors = [ln for ln in tail if "Error" in ln or ln.startswith("error:")]
    return {
        "rc": rc,
        "exit_s": round(time.perf_counter() - t0, 2),
        **{k: round(v, 2) for k, v in seen.items()},
        "last_error": errors[-1][:240] if errors else "",
    }


def build_cases(workdir: Path) -> list[dict]:
    """A tiny Llama and DeepseekV3, prepared data, and one misconfigured copy per case."""
    from pipeline.prepare import PrepareConfig
    from pipeline.prepare import run as prepare
    from pipeline.demo.tiny import build_tiny_model, write_conversations

    llama = build_tiny_model("llama", workdir / "llama")
    deepseek = build_tiny_model("deepseek_v3", workdir / "deepseek")
    write_conversations(workdir / "conv.jsonl", n=40)
    prepared = workdir / "prepared"
    prepare(
        PrepareConfig(
            data=workdir / "conv.jsonl",
            model=llama,
            out=prepared,
            seq_length=128,
            draft_vocab_size=128,
            overwrite=True,
        )
    )

    def variant(src: Path, name: str, **changes) -> Path:
        dst = workdir / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
        return dst

    bad_vocab = workdir / "prepared-bad-vocab"
    shutil.rmtree(bad_vocab, ignore_errors=True)
    shutil.copytree(prepared, bad_vocab)
    t2d = np.load(bad_vocab / "t2d.npy")
    np.save(bad_vocab / "t2d.npy", np.concatenate([t2d, np.zeros(1000, dtype=bool)]))
    return [
        {
            "case": "config claims 9 layers, checkpoint has 8",
            "model": variant(llama, "llama-9-layers", num_hidden_layers=9),
            "prepared": prepared,
        },
        {
            "case": "t2d.npy of another vocab (2024 entries, model 1024)",
            "model": llama,
            "prepared": bad_vocab,
        },
        {
            "case": "layer ids beyond the model (--layer-ids 2,4,5,9 on 8 layers)",
            "model": llama,
            "prepared": prepared,
            "args": ["--layer-ids", "2,4,5,9"],
        },
        {
            "case": "DeepseekV3 config without scoring_func (vLLM: softmax)",
            "model": variant(deepseek, "deepseek-no-scoring", scoring_func=None),
            "prepared": prepared,
        },
    ]


@click.command()
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path("/tmp/preflight-bench"), show_default=True
)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
@click.option("--timeout", type=float, default=600, show_default=True, help="Per extract run.")
def main(workdir: Path, json_out: Path | None, timeout: float) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in build_cases(workdir):
        common = ["--model", str(case["model"]), "--prepared", str(case["prepared"]), *case.get("args", [])]
        out = workdir / "out"
        shutil.rmtree(out, ignore_errors=True)
        pre = timed_run(
            [sys.executable, "-m", "pipeline", "preflight", *common, "--out", str(out)],
            {"first_fail": "] fail"},
            timeout=120,
        )
        ext = timed_run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "extract",
                "--backend",
                "vllm",
                *common,
                "--out",
                str(out),
                "--limit",
                "16",
                "--no-progress",
                "--tensor-parallel-size",
                "1",
                "--enforce-eager",
            ],
            {"model_load": LOAD_MARK},
            timeout=timeout,
        )
        rows.append({"case": case["case"], "preflight": pre, "extract": ext})
        click.echo(json.dumps(rows[-1]), err=True)
    click.echo(
        "| misconfiguration | preflight: first fail | preflight: exit (rc) | extract: model load starts | "
        "extract: exit (rc) |"
    )
    click.echo("|---|---:|---:|---:|---:|")
    for r in rows:
        p, e = r["preflight"], r["extract"]
        click.echo(
            f"| {r['case']} | {p.get('first_fail', '-')} s | {p['exit_s']} s ({p['rc']}) | "
            f"{e.get('model_load', '-')} s | {e['exit_s']} s ({e['rc']}) |"
        )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
