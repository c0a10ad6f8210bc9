"""`extract --expert-parallel` (vLLM's expert parallelism for an MoE target) where it cannot apply: refused in
one line before anything loads, by check-args (with --backend hf), by the stage (auto chose hf; a dense
model; no GPU: the vLLM CPU build's fused-MoE kernel segfaults under it) and by the preflight (before an ops
run stops the server). Its engine arguments are tests/vllm/test_vllm_guards.py's; a run needs two GPUs
(docs/vllm.md, "Not verified here")."""

from __future__ import annotations

from pipeline.model.modeldir import read_model_dir
from pipeline.preflight import PreflightConfig, check_model
from tests.conftest import run_extract, run_pipeline


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_check_args_refuses_it_with_the_hf_backend():
    """The ops preflight's first check: `FAIL arguments: ...` naming the flag and the way out, exit 2."""
    proc = run_pipeline(
        "check-args", "extract", "--prepared", "p", "--model", "m", "--out", "o", "--backend", "hf",
        "--expert-parallel",
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout.startswith("FAIL arguments: pipeline extract: "), proc.stdout
    assert "--expert-parallel is the vllm backend's" in proc.stdout and "--backend vllm" in proc.stdout


def test_extract_refuses_it_where_auto_chose_hf_the_model_is_dense_or_no_gpu_is_seen(
    tmp_path, tiny_llama, tiny_deepseek, prepared_llama
):
    """No GPU here: auto chooses hf, and the flag is refused naming the backend; with --backend vllm the
    tiny Llama is refused as dense, and the tiny DeepSeek (an MoE) for want of a GPU. No run writes into
    --out, and none needs vLLM installed to say so (this environment has none)."""
    out = tmp_path / "states"
    line = one_error_line(run_extract(prepared_llama, tiny_llama, out, "--expert-parallel", "--no-progress"))
    assert "this run's backend is hf" in line
    proc = run_extract(
        prepared_llama, tiny_llama, out, "--backend", "vllm", "--expert-parallel", "--no-progress"
    )
    line = one_error_line(proc)
    assert "is a dense model" in line and str(tiny_llama) in line and "drop --expert-parallel" in line
    proc = run_extract(
        prepared_llama, tiny_deepseek, out, "--backend", "vllm", "--expert-parallel", "--no-progress"
    )
    assert "--expert-parallel needs GPUs" in one_error_line(proc)
    assert not out.exists() or not any(out.iterdir())


def test_the_preflight_file_checks_say_it_before_anything_stops(tiny_llama, tiny_deepseek):
    """`expert parallel` fails for a dense model or the hf backend, and passes for the tiny DeepSeek (8
    routed experts, 2 a token) on vllm; without the flag there is no such check."""

    def check(model, backend="vllm", flag=True):
        cfg = PreflightConfig(model=model, backend=backend, expert_parallel=flag)
        return [r for r in check_model(cfg) if r.name == "expert parallel"]

    (dense,) = check(tiny_llama)
    assert dense.failed and "is a dense model" in dense.detail
    (hf,) = check(tiny_deepseek, backend="hf")
    assert hf.failed and "this run's backend is hf" in hf.detail
    (moe,) = check(tiny_deepseek)
    assert not moe.failed and "8 routed experts (2 per token)" in moe.detail
    assert check(tiny_deepseek, flag=False) == []


def test_the_preflight_says_no_gpu_means_no_expert_parallel(tiny_deepseek):
    """Its device checks (they import torch): no GPU visible, the flag fails `expert parallel`."""
    from pipeline.preflight import check_parallel

    cfg = PreflightConfig(model=tiny_deepseek, backend="vllm", expert_parallel=True)
    model = read_model_dir(tiny_deepseek)
    (ep,) = [r for r in check_parallel(cfg, model, model.raw) if r.name == "expert parallel"]
    assert ep.failed and "needs GPUs" in ep.detail
    without = PreflightConfig(model=tiny_deepseek, backend="vllm")
    assert [r for r in check_parallel(without, model, model.raw) if r.name == "expert parallel"] == []
