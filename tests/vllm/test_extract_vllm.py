"""`extract --backend vllm` on a real vLLM 0.32.0 (CPU build, native extract_hidden_states) against
`--backend hf`, batched vs one-by-one, resume after SIGKILL, data parallel.

Tolerance (fp32 on both sides, so that a real mismatch cannot hide in bf16 rounding): the worst relative
error of any single token's vector, ||vllm_t - hf_t|| / ||hf_t||, over all samples and the 4 layers, must
stay below 1e-5 on the CPU (seen on 0.16.0: 4e-7 for the Llama at TP 1 and 2, 8e-7 for the DeepseekV3 with MLA
disabled) and 3e-3 on a GPU, where vLLM's Triton attention runs fp32 dots as TF32 (conftest.py says why).
An off-by-one layer (vLLM's ids are layer INPUTS: ours + 1), a missing layer, a reordered sample, the CPU rope
bug (vLLM patch 0002: 37-53% from layer 2 on) or softmax-instead-of-sigmoid MoE routing (up to 0.9) all
exceed it by orders of magnitude. Engines run with --enforce-eager: torch.compile on this CPU adds minutes.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from pipeline.ondisk import formats
from tests.conftest import run_pipeline
from tests.vllm.conftest import compare_dirs, fp32_tolerance, per_token_rel

pytestmark = pytest.mark.vllm

TOL = fp32_tolerance()  # tests/vllm/conftest.py: 1e-5 on the CPU, TF32 attention on a GPU
LIMIT = 40  # samples per extraction


def extract(backend: str, prepared, model, out, *extra) -> str:
    """The run's stderr."""
    eager = ("--enforce-eager",) if backend == "vllm" else ()
    return run_pipeline(
        "extract",
        "--backend",
        backend,
        "--dtype",
        "float32",
        "--prepared",
        prepared,
        "--model",
        model,
        "--out",
        out,
        "--limit",
        LIMIT,
        "--no-progress",
        *eager,
        *extra,
        check=True,
        timeout=900,
    ).stderr


@pytest.fixture(scope="module")
def hf_llama_states(tmp_path_factory, prepared_llama, tiny_llama):
    out = tmp_path_factory.mktemp("hf") / "llama"
    extract("hf", prepared_llama, tiny_llama, out)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_llama_matches_hf(tp, tmp_path, prepared_llama, tiny_llama, hf_llama_states):
    """extract --backend vllm on the tiny Llama at tensor parallel 1 and 2 writes the hf backend's files; at
    1 the engine runs in the extract process and hands the states over in memory, at 2 its rank-0 worker
    process writes them to files."""
    out = tmp_path / f"vllm-tp{tp}"
    log = extract("vllm", prepared_llama, tiny_llama, out, "--tensor-parallel-size", tp)
    memory, files = "hands each request's states over in memory", "per-request files wait in"
    assert (memory in log, files in log) == ((True, False) if tp == 1 else (False, True)), log[-2000:]
    result = compare_dirs(out, hf_llama_states)
    assert result["files"] == LIMIT
    assert max(result["worst_per_layer"]) < TOL, result["worst_per_layer"]
    config = formats.read_data_config(out)
    assert (config.backend, config.dtype, config.layer_ids, config.num_samples) == (
        "vllm",
        "float32",
        [2, 4, 5, 7],
        LIMIT,
    )
    lengths = formats.read_sample_lengths(out)
    assert lengths == formats.read_sample_lengths(hf_llama_states)
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["ok"] and summary["stats"]["closing_check"] == "record"
    )  # the shared writer recorded every file


def test_vllm_deepseek_v3_matches_hf(tmp_path, prepared_llama, deepseek_for_vllm):
    """extract --backend vllm on the tiny DeepseekV3 (MoE, MLA disabled on CPU) matches --backend hf. On a GPU
    vLLM's MLA attention takes no fp32 (the H200 engine died at start): the run is refused in one line before
    anything loads; the bf16 comparison of a DeepSeek-V3-layout model is test_kimi_k25's."""
    hf, vl = tmp_path / "hf", tmp_path / "vllm"
    if torch.cuda.is_available():
        proc = run_pipeline(
            "extract", "--backend", "vllm", "--dtype", "float32", "--prepared", prepared_llama,
            "--model", deepseek_for_vllm, "--out", vl, "--limit", LIMIT, "--no-progress",
        )  # fmt: skip
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and "cannot run in float32" in last and "--dtype bfloat16" in last, last
        assert not list(vl.glob("data_*.pt"))
        return
    extract("hf", prepared_llama, deepseek_for_vllm, hf)
    extract("vllm", prepared_llama, deepseek_for_vllm, vl, "--tensor-parallel-size", 1)
    result = compare_dirs(vl, hf)
    assert result["files"] == LIMIT
    assert max(result["worst_per_layer"]) < TOL, result["worst_per_layer"]


def test_vllm_resume_after_sigkill_is_byte_identical(tmp_path, prepared_llama, tiny_llama):
    """An extraction SIGKILLed once files exist resumes to files byte-identical to an uninterrupted vllm run,
    and leaves no scratch folder of the killed engine behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    extract("vllm", prepared_llama, tiny_llama, whole, "--tensor-parallel-size", 1, "--max-batch-tokens", 512)
    argv = [
        sys.executable,
        "-m",
        "pipeline",
        "extract",
        "--backend",
        "vllm",
        "--dtype",
        "float32",
        "--prepared",
        str(prepared_llama),
        "--model",
        str(tiny_llama),
        "--out",
        str(cut),
        "--limit",
        str(LIMIT),
        "--no-progress",
        "--enforce-eager",
        "--tensor-parallel-size",
        "1",
        "--max-batch-tokens",
        "512",
        "--no-verify",
    ]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while len(formats.existing_data_indices(cut)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the stage and the engine's processes, as a lost host would
    proc.wait()
    done = formats.existing_data_indices(cut)
    assert 5 <= len(done) < LIMIT, len(done)
    extract(
        "vllm",
        prepared_llama,
        tiny_llama,
        cut,
        "--tensor-parallel-size",
        1,
        "--max-batch-tokens",
        512,
        "--resume",
    )
    assert formats.existing_data_indices(cut) == formats.existing_data_indices(whole) == list(range(LIMIT))
    for i in range(LIMIT):
        assert formats.data_file(cut, i).read_bytes() == formats.data_file(whole, i).read_bytes(), i
    assert not list(cut.glob(".vllm-states-*")) and not list(whole.glob(".vllm-states-*"))


def test_vllm_data_parallel_writes_one_set(tmp_path, prepared_llama, tiny_llama, hf_llama_states):
    """--data-parallel 2 runs two engines (one per worker) and writes the hf backend's set."""
    out = tmp_path / "dp"
    extract("vllm", prepared_llama, tiny_llama, out, "--data-parallel", 2)
    result = compare_dirs(out, hf_llama_states)
    assert result["files"] == LIMIT and max(result["worst_per_layer"]) < TOL


def _mixed_batch(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 5, 17, 33, 64, 100, 127]) for _ in range(n)]
    return [[rng.randrange(6, 1000) for _ in range(t)] for t in lengths]


def test_batched_equals_one_by_one_beyond_step_and_seq_limits(llama_backend_small_steps):
    """A 45-sequence batch of mixed lengths (2,000+ tokens in steps of <= 128, > 32 sequences) equals
    one-by-one."""
    backend = llama_backend_small_steps
    batch = _mixed_batch(45, seed=1)
    batch.append(list(batch[7]))  # a duplicate must come back twice, at its own position
    assert sum(map(len, batch)) > 10 * backend.settings["max_num_batched_tokens"]
    batched = backend.capture(batch)
    singles = [backend.capture([seq])[0] for seq in batch]
    assert len(batched) == len(batch)
    for i, (seq, got, want) in enumerate(zip(batch, batched, singles, strict=True)):
        assert [tuple(h.shape) for h in got] == [(len(seq), 256)] * 4, i
        for k, (x, y) in enumerate(zip(got, want, strict=True)):
            # on a GPU a step's kernels depend on its batch (TF32 attention: 1.3e-5 seen on the H200)
            assert per_token_rel(x, y) < TOL, (i, k, per_token_rel(x, y))
    # the four captured layers are four different layers (the field bug kept one of four)
    states = batched[0]
    assert min(per_token_rel(states[a], states[b]) for a in range(4) for b in range(a + 1, 4)) > 0.05


def test_backend_states_are_the_hf_layer_outputs(llama_backend_small_steps, tiny_llama):
    """Each of the 4 vLLM states equals the hf backend's output of the same layer (not its input, not
    another)."""
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.hf import HFBackend
    from pipeline.model.modeldir import read_model_dir

    batch = _mixed_batch(6, seed=2)
    hf = HFBackend(
        BackendOptions(
            model=read_model_dir(tiny_llama), layer_ids=(2, 4, 5, 7), device="cpu", dtype="float32"
        )
    )
    want = hf.capture(batch)
    got = llama_backend_small_steps.capture(batch)
    for w, g in zip(want, got, strict=True):
        for k in range(4):
            assert per_token_rel(g[k], w[k]) < TOL
            if k:
                assert per_token_rel(g[k], w[k - 1]) > 0.05  # a neighbouring layer would not pass


def test_backend_rejects_sequences_longer_than_seq_length(llama_backend_small_steps):
    """A sequence longer than seq_length - 1 is a one-line StageError, not a silent truncation."""
    from pipeline.errors import StageError

    with pytest.raises(StageError, match="seq_length - 1"):
        llama_backend_small_steps.capture([[7] * 200])


def test_forced_settings_are_in_effect(llama_backend_small_steps):
    """Prefix caching and chunked prefill are off, and vLLM's aux layers are ours + 1, in the live engine."""
    s = llama_backend_small_steps.settings
    assert (s["enable_prefix_caching"], s["enable_chunked_prefill"], s["enforce_eager"]) == (
        False,
        False,
        True,
    )
    assert s["aux_layer_ids"] == [3, 5, 6, 8]
    assert llama_backend_small_steps.dtype == torch.float32
    assert llama_backend_small_steps.handoff == "memory"  # tensor parallel 1: the engine runs in this process
    # our connector (per-layer states and their facts), not vLLM's, in the live engine
    assert (s["kv_connector"], s["kv_connector_module_path"]) == (
        "EagleStatesConnector",
        "pipeline.backends.vllm_connector",
    )


def test_a_second_engine_beside_an_in_process_one_is_refused_and_the_first_keeps_working(
    llama_backend_small_steps, tiny_llama, tmp_path
):
    """While an engine whose core runs in this process is open, another VllmBackend is refused in one line
    before anything is built: vLLM's close of either would destroy the model-parallel groups both use (seen:
    "pipeline model parallel group is not initialized" in the open one's next step), and the in-memory
    hand-over is one per process. The open engine still captures afterwards."""
    from pipeline.errors import StageError

    with pytest.raises(StageError, match="still open: close it before building another") as err:
        tp1_backend(tiny_llama, tmp_path)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "scratch").exists()
    assert llama_backend_small_steps.capture([[1, 2, 3, 4, 5]])[0][0].shape == (5, 256)


def test_vllm_extracts_from_a_model_folder_without_tokenizer_files(tmp_path, prepared_llama, tiny_llama):
    """A model folder with only config and weights (bench/gpu_models.py writes such folders) extracts with the
    vllm backend: the engine starts without a tokenizer (it is handed token ids), where vLLM 0.32 loading one
    at engine start died in a transformers traceback (the first H200 run, 2026-12-03)."""
    import shutil

    bare = tmp_path / "bare-model"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(tiny_llama / name, bare / name)
    assert not any(p.name.startswith("tokenizer") for p in bare.iterdir())
    out = tmp_path / "states"
    run_pipeline(
        "extract",
        "--backend",
        "vllm",
        "--dtype",
        "float32",
        "--prepared",
        prepared_llama,
        "--model",
        bare,
        "--out",
        out,
        "--limit",
        4,
        "--no-progress",
        "--enforce-eager",
        "--tensor-parallel-size",
        1,
        check=True,
        timeout=900,
    )
    assert formats.existing_data_indices(out) == [0, 1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["ok"]


def tp1_backend(model_dir, tmp_path, dtype: str = "float32"):
    """A fresh TP-1 eager VllmBackend on ``model_dir``: its engine core runs in this process."""
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.vllm import VllmBackend
    from pipeline.model.modeldir import read_model_dir

    return VllmBackend(
        BackendOptions(
            model=read_model_dir(model_dir),
            layer_ids=(2, 4, 5, 7),
            dtype=dtype,
            seq_length=64,
            tensor_parallel_size=1,
            enforce_eager=True,
            scratch_dir=tmp_path / "scratch",
        )
    )


def engine_model(backend) -> torch.nn.Module:
    """The model the in-process engine's worker runs (vLLM 0.32's object path; the test fails on another)."""
    core = backend._llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.model


@pytest.mark.usefixtures("no_shared_engine")
def test_close_lets_go_of_the_engines_model(tiny_llama, tmp_path):
    """After close() nothing holds the in-process engine's model (its weights, and on a GPU its KV cache,
    are what a later engine or `vllm serve` in this process needs back)."""
    import gc
    import weakref

    backend = tp1_backend(tiny_llama, tmp_path)
    model = weakref.ref(engine_model(backend))
    assert backend.capture([[1, 2, 3, 4, 5]])[0][0].shape == (5, 256)
    assert model() is not None
    backend.close()
    gc.collect()
    assert model() is None, gc.get_referrers(model())


@pytest.mark.usefixtures("no_shared_engine")
def test_the_requests_finished_in_one_step_are_saved_together(tiny_llama, tmp_path, monkeypatch):
    """Our connector saves the requests that finished in a step all at once (one gather, one token_scales
    per layer: the per-request way held the H200's engine thread ~4 s of a 9 s loop), each request once, and
    the states are those of the one-by-one capture."""
    from pipeline.backends.vllm_connector import EagleStatesConnector

    saved: list[list[str]] = []
    save_step = EagleStatesConnector._save_step

    def counting(self, pendings):
        saved.append([p.req_id for p in pendings])
        return save_step(self, pendings)

    monkeypatch.setattr(EagleStatesConnector, "_save_step", counting)
    batch = _mixed_batch(12, seed=3)
    backend = tp1_backend(tiny_llama, tmp_path)
    try:
        together = backend.capture([s[:60] for s in batch])
        saved_together = list(saved)
        alone = [backend.capture([s[:60]])[0] for s in batch]
    finally:
        backend.close()
    ids = [i for step in saved_together for i in step]
    assert len(ids) == len(set(ids)) == len(batch), saved_together
    assert max(map(len, saved_together)) >= 4, saved_together  # 12 sequences of <= 60 tokens: 1-3 steps
    for got, want in zip(together, alone, strict=True):
        for x, y in zip(got, want, strict=True):
            assert x.untyped_storage().nbytes() == x.nbytes  # its own, not a view of the step's buffer
            assert per_token_rel(x, y) < TOL  # on a GPU a step's kernels depend on its batch: TF32's bound


@pytest.mark.gpu
@pytest.mark.usefixtures("no_shared_engine")
def test_close_gives_the_gpu_memory_back(tiny_llama, tmp_path):
    """An engine takes vLLM's share of the GPU (0.92); after close() the device has it back, so a second
    engine or `vllm serve` can start in or beside this process (both found 10.7 of 139.8 GiB free on the
    H200 before close() emptied torch's allocator cache)."""
    free_before, total = torch.cuda.mem_get_info()
    backend = tp1_backend(tiny_llama, tmp_path, dtype="bfloat16")
    backend.capture([[1, 2, 3, 4, 5]])
    free_during = torch.cuda.mem_get_info()[0]
    assert free_before - free_during > 0.5 * total, (free_before, free_during, total)
    backend.close()
    free_after = torch.cuda.mem_get_info()[0]
    print(f"\nGPU free: {free_before / 2**30:.1f} GiB before, {free_during / 2**30:.1f} with the engine, "
          f"{free_after / 2**30:.1f} after close")  # fmt: skip
    assert free_after >= free_before - 2 * 2**30, (free_before, free_after)


@pytest.mark.usefixtures("no_shared_engine")
def test_an_in_process_engine_inspects_its_model_classes_here(tiny_llama, tmp_path, monkeypatch):
    """vLLM inspects each model class in a fresh Python process when its modelinfo cache is cold (46 of the
    77 s before the H200's first batch). An engine whose core runs in this process does it here: with a cold
    VLLM_CACHE_ROOT and vLLM's spawning hook replaced by one that fails, the engine still builds, vLLM's
    cache holds both classes (target, drafter) afterwards, and the hook is vLLM's again once it is built."""
    from vllm.model_executor.models import registry

    def spawn(fn):
        raise AssertionError("a model class was inspected in a subprocess")

    monkeypatch.setattr(registry, "_run_in_subprocess", spawn)
    monkeypatch.delenv("VLLM_NO_USAGE_STATS", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    registry._try_inspect_model_cls.cache_clear()  # engines built earlier in this session inspected them
    backend = tp1_backend(tiny_llama, tmp_path)
    try:
        assert backend.handoff == "memory"  # the core runs here
        assert registry._run_in_subprocess is spawn
        assert os.environ["VLLM_NO_USAGE_STATS"] == "1"  # no usage report to vLLM's authors
        cached = sorted(p.name for p in (tmp_path / "vllm-cache" / "modelinfos").iterdir())
        assert any("LlamaForCausalLM" in name for name in cached), cached
        assert any("ExtractHiddenStates" in name for name in cached), cached
    finally:
        backend.close()


def test_an_hf_extraction_imports_no_vllm(tmp_path, prepared_llama, tiny_llama, monkeypatch):
    """Where vLLM is installed (the image), an hf run never imports it: counting the GPUs through vLLM cost
    every hf extraction ~0.7-1.7 s of imports (vLLM pulls in torch's inductor; docs/benchmarks.md)."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # each import on stderr, `| vllm` when vLLM's is
    out = tmp_path / "states"
    args = (
        "extract", "--backend", "hf", "--prepared", prepared_llama, "--model", tiny_llama, "--out", out,
        "--limit", LIMIT, "--no-progress",
    )  # fmt: skip
    proc = run_pipeline(*args, cold=True)  # a new interpreter: the import log is this run's own
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {
        ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time")
    }
    assert "torch" in imported  # the import log is there: the check below can fail
    assert not {m for m in imported if m == "vllm" or m.startswith("vllm.")}, sorted(imported)[:20]
    assert formats.existing_data_indices(out) == list(range(LIMIT))
