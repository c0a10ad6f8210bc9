"""Fixtures of the vLLM CPU tests: a guard that we run in the vLLM environment, shared backends, helpers.

These tests run with .venv-vllm's python (`make test-vllm`); in any other environment they FAIL (never
skip), since CI builds that environment. One VllmBackend per model and settings is shared by the whole
session: each costs an engine start (~15-20 s on 2 cores in eager mode; torch.compile adds minutes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pipeline.ondisk import formats
from pipeline.train import states
from tests.conftest import run_pipeline
from tests.train.states_helpers import make_stage_inputs, states_config

REPO = Path(__file__).resolve().parents[2]

# The worst per-token relative error allowed between vLLM's and transformers' fp32 states. On the CPU both
# are plain fp32 (seen: 4e-7 to 8e-7). On a CUDA GPU vLLM computes fp32 attention in Triton kernels, whose
# fp32 dots run as TF32 by default (10-bit mantissa, ~5e-4 per rounding); vLLM keeps its matmuls at
# "highest" precision (VLLM_FLOAT32_MATMUL_PRECISION), and transformers' SDPA is plain fp32, so TF32 enters
# on vLLM's side only, in attention. Seen on the H200: 9.4e-4 (2026-12-03). An off-by-one layer, a lost
# layer or a reordered sample are O(1) errors, far above either bound.
FP32_TOL_CPU = 1e-5
FP32_TOL_CUDA = 3e-3


def fp32_tolerance() -> float:
    return FP32_TOL_CUDA if torch.cuda.is_available() else FP32_TOL_CPU


def held_engine_share() -> float | None:
    """The GPU memory share of an engine a fixture keeps for the whole session. vLLM's default 0.92 would
    hold the card, and every later engine (a test's own, or a `pipeline extract` subprocess, which asks for
    0.92 of the GPU free at start) would then refuse to start: seen on the H200, "Free memory on device
    cuda:0 (10.06/139.8 GiB) on startup is less than desired GPU memory utilization (0.92, 128.62 GiB)".
    0.05 (7 GB on an H200) holds a tiny model's engine and leaves the 0.92 free; None on the CPU build,
    which sizes its KV cache by VLLM_CPU_KVCACHE_SPACE."""
    return 0.05 if torch.cuda.is_available() else None


@pytest.fixture(autouse=True)
def vllm_environment(request) -> None:
    """Fail (not skip) a `vllm`-marked test when vLLM/speculators are missing; unmarked unit tests run
    anywhere."""
    if request.node.get_closest_marker("vllm") is None:
        return
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(
            "vllm-marked tests need the vLLM CPU environment "
            f"(make env-vllm; run with .venv-vllm/bin/python): {exc}"
        )


@pytest.fixture(autouse=True)
def gpu_present(request) -> None:
    """Fail (not skip) a `gpu`-marked test where no CUDA GPU is visible: `make test-vllm` deselects them."""
    if request.node.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.fail("gpu-marked tests need a CUDA GPU (make test-vllm-gpu on a GPU host)")


class SharedEngine:
    """The session's TP-1 engine on the tiny Llama, its core in the pytest process: built when a test first
    asks for it, kept for the next, closed by ``no_shared_engine`` before a test builds an in-process engine
    of its own. One per process: vLLM's close of an in-process engine destroys the model-parallel groups
    every engine of the process shares, and VllmBackend refuses a second one while one is open."""

    def __init__(self, tiny_llama: Path, scratch: Path):
        self.tiny_llama, self.scratch, self.backend = tiny_llama, scratch, None

    def get(self):
        from pipeline.backends.base import BackendOptions
        from pipeline.backends.vllm import VllmBackend
        from pipeline.model.modeldir import read_model_dir

        if self.backend is None:
            self.backend = VllmBackend(
                BackendOptions(
                    model=read_model_dir(self.tiny_llama),
                    layer_ids=(2, 4, 5, 7),
                    dtype="float32",
                    seq_length=128,
                    tensor_parallel_size=1,
                    max_batch_tokens=128,
                    enforce_eager=True,
                    scratch_dir=self.scratch,
                    memory_share=held_engine_share(),
                )
            )
        return self.backend

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()


@pytest.fixture(scope="session")
def shared_engine(tiny_llama, tmp_path_factory):
    shared = SharedEngine(tiny_llama, tmp_path_factory.mktemp("vllm-scratch"))
    yield shared
    shared.close()


@pytest.fixture
def llama_backend_small_steps(shared_engine):
    """A TP-1 fp32 eager VllmBackend on the tiny Llama whose scheduler steps hold at most 128 tokens, shared
    by the tests that ask for it (``SharedEngine``)."""
    return shared_engine.get()


@pytest.fixture
def no_shared_engine(shared_engine) -> None:
    """For a test that builds an engine in the pytest process (its own backend, an in-process train run with
    the vllm producer): the shared engine closed first, whatever ran before."""
    shared_engine.close()


def per_token_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest relative error of one token's vector: ||a_t - b_t|| / ||b_t||."""
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).max())


def compare_dirs(got: Path, want: Path) -> dict:
    """Compare two hidden-states dirs file by file: ids and masks equal; worst per-token error per layer."""
    got_ids, want_ids = formats.existing_data_indices(got), formats.existing_data_indices(want)
    assert got_ids == want_ids and got_ids, (got_ids[:5], want_ids[:5])
    worst = [0.0] * 4
    token_errors = []
    for i in got_ids:
        a, b = formats.read_sample(formats.data_file(got, i)), formats.read_sample(formats.data_file(want, i))
        assert torch.equal(a["input_ids"], b["input_ids"]), f"sample {i}: input_ids differ"
        assert torch.equal(a["loss_mask"], b["loss_mask"]), f"sample {i}: loss_mask differ"
        assert len(a["hidden_states"]) == len(b["hidden_states"]) == 4, f"sample {i}: not 4 layers"
        for k, (x, y) in enumerate(zip(a["hidden_states"], b["hidden_states"], strict=True)):
            assert x.shape == y.shape and x.dtype == y.dtype, (i, k, x.shape, y.shape, x.dtype, y.dtype)
            worst[k] = max(worst[k], per_token_rel(x, y))
            token_errors.append(((x.float() - y.float()).norm(dim=-1) / y.float().norm(dim=-1)))
    per_layer = [torch.cat(token_errors[k::4]) for k in range(4)]
    return {
        "files": len(got_ids),
        "worst_per_layer": worst,
        "token_errors": torch.cat(token_errors),
        "median_per_layer": [float(e.median()) for e in per_layer],
        "token_errors_per_layer": per_layer,
    }


def share_at_or_above(result: dict, tol: float) -> list[float]:
    """Per layer: the share of tokens of a ``compare_dirs`` result whose relative error is ``tol`` or more."""
    return [float((e >= tol).float().mean()) for e in result["token_errors_per_layer"]]


def copy_model(src: Path, dst: Path, drop: tuple[str, ...] = (), **config_changes) -> Path:
    """A copy of a model dir with config.json keys changed (and the keys in ``drop`` removed)."""
    import json

    shutil.copytree(src, dst, copy_function=shutil.copy)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    for key in drop:
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="session")
def deepseek_for_vllm(tiny_deepseek, tmp_path_factory) -> Path:
    """The tiny DeepseekV3 with "scoring_func": "sigmoid" in config.json (what real DeepSeek-V3/Kimi configs
    carry).

    transformers' DeepseekV3 always scores with sigmoid; vLLM reads scoring_func and defaults to softmax, so a
    config without it routes differently in vLLM (the preflight's "moe routing" check fails on it).
    """
    import json

    if json.loads((tiny_deepseek / "config.json").read_text()).get("scoring_func") == "sigmoid":
        return tiny_deepseek
    return copy_model(
        tiny_deepseek, tmp_path_factory.mktemp("dsv3-sigmoid") / "model", scoring_func="sigmoid"
    )


# ---------------------------------------------------------------- produced states with the vllm backend
# (tests/vllm/test_train_states_vllm.py, and its 2-GPU module)


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory, tiny_llama, conversations) -> dict:
    return make_stage_inputs(tmp_path_factory.mktemp("vllm-states-inputs"), tiny_llama, conversations)


@pytest.fixture(scope="module")
def offline(stage_inputs, tmp_path_factory) -> dict:
    """The reference: `pipeline extract --backend vllm` (fp32, eager, tensor parallel 1) of the prepared
    set, then offline training on it, in process."""
    from pipeline.train.stage import run

    root = tmp_path_factory.mktemp("vllm-offline")
    run_pipeline(
        *("extract", "--backend", "vllm", "--dtype", "float32", "--enforce-eager"),
        *("--tensor-parallel-size", 1, "--no-progress"),
        *("--prepared", stage_inputs["prepared"], "--model", stage_inputs["model"], "--out", root / "states"),
        check=True,
        timeout=900,
    )
    cfg = states_config(stage_inputs, root / "states", root / "out")
    return {"cfg": cfg, "summary": run(cfg, log=lambda m: None)}


def vllm_config(stage_inputs, tmp_path: Path, **overrides):
    return states_config(
        stage_inputs,
        tmp_path / "states",
        tmp_path / "out",
        states_backend="vllm",
        states_dtype="float32",
        **overrides,
    )


def budget(stage_inputs, held: int, extra_samples: int = 2) -> str:
    """Room for the ``held`` largest samples and ``extra_samples`` more of the largest, by the plan's own
    per-sample bound for the vllm backend (``states.disk_bytes``): well under the whole set."""
    prepared, _ = formats.read_prepared(stage_inputs["prepared"])
    sizes = sorted(states.disk_bytes(t, 256, 4, 4, "vllm") for t in prepared.lengths())
    return str(sum(sizes[-held:]) + extra_samples * sizes[-1])
