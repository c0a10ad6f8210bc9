"""The hf backend and the extract loop: states equal a reference forward, padding never leaks, resume is
exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline.ondisk import formats
from pipeline.backends.base import BackendOptions
from pipeline.backends.hf import HFBackend
from pipeline.extract.plan import Batch, plan_batches
from pipeline.extract.resume import pending_batches
from pipeline.model.modeldir import read_model_dir
from tests.conftest import REPO, run_pipeline

# fp32: the batch (padded, masked) and the unpadded reference differ only by summation order.
FP32_ATOL, FP32_RTOL = 2e-5, 1e-4
# bf16: one rounding of the residual stream per layer; relative error of the whole tensor.
BF16_REL = 2e-2

SEQS = [
    [1, 3, 17, 250, 251, 99, 7, 8, 9, 10, 11, 12, 400, 401, 5],
    [1, 3, 42, 43, 44],
    [1, 3, 600, 601, 602, 603, 604, 605, 606],
]


def reference(model_dir, seq, dtype):
    """Per-sample unpadded forward with output_hidden_states=True, and the final norm module."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], model.model.norm


def expected_states(model_dir, seq, layer_ids, dtype):
    """What a capture must equal: hidden_states[k+1] for k < L-1; for L-1, norm(captured) ==
    hidden_states[L]."""
    hs, norm = reference(model_dir, seq, dtype)
    return [hs[k + 1] for k in layer_ids[:-1]], hs[-1], norm


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "mixed-batch"])
def test_captured_states_equal_reference_forward_fp32(family, batched, tiny_llama, tiny_deepseek):
    """fp32 capture equals transformers' output_hidden_states (index k+1; last layer through the final
    norm)."""
    model_dir = tiny_llama if family == "llama" else tiny_deepseek
    md = read_model_dir(model_dir)
    layer_ids = (2, 4, 5, 7)
    backend = HFBackend(BackendOptions(model=md, layer_ids=layer_ids, device="cpu", dtype="float32"))
    captured = backend.capture(SEQS) if batched else [backend.capture([s])[0] for s in SEQS]
    for seq, states in zip(SEQS, captured, strict=True):
        inter, last_normed, norm = expected_states(model_dir, seq, layer_ids, torch.float32)
        assert [tuple(h.shape) for h in states] == [(len(seq), md.hidden_size)] * 4
        for got, want in zip(states[:-1], inter, strict=True):
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=FP32_RTOL)
        with torch.inference_mode():
            torch.testing.assert_close(norm(states[-1]), last_normed, atol=FP32_ATOL, rtol=FP32_RTOL)
        # the capture is pre-norm: it must NOT already equal the normed last entry
        assert rel_err(states[-1], last_normed) > 0.1


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_captured_states_match_reference_in_bf16(family, tiny_llama, tiny_deepseek):
    """bf16 capture of a mixed-length batch is within bf16 error of the bf16 one-sample reference, or, where
    the two bf16 runs part (an MoE's near-tied routing flips an expert when batched kernels round otherwise:
    seen for DeepseekV3 on an AMX-BF16 CPU), no farther from the fp32 reference than that bf16 run is."""
    model_dir = tiny_llama if family == "llama" else tiny_deepseek
    md = read_model_dir(model_dir)
    backend = HFBackend(BackendOptions(model=md, layer_ids=(2, 4, 5, 7), device="cpu", dtype="bfloat16"))
    for seq, states in zip(SEQS, backend.capture(SEQS), strict=True):
        inter, last_normed, norm = expected_states(model_dir, seq, (2, 4, 5, 7), torch.bfloat16)
        exact, exact_last, _ = expected_states(model_dir, seq, (2, 4, 5, 7), torch.float32)
        assert all(h.dtype == torch.bfloat16 for h in states)
        with torch.inference_mode():
            pairs = [
                *zip(states[:-1], inter, exact, strict=True),
                (norm(states[-1]), last_normed, exact_last),
            ]
        for got, want, fp32 in pairs:
            assert rel_err(got, want) < BF16_REL or rel_err(got, fp32) <= 1.5 * rel_err(want, fp32) + 1e-3, (
                rel_err(got, want),
                rel_err(got, fp32),
                rel_err(want, fp32),
            )


def test_padding_never_leaks(tiny_llama):
    """In a mixed batch each sample keeps exactly its own T rows, equal to its batch-of-one result,
    and its tensors own storage of exactly T x H elements (no padded batch behind a view)."""
    md = read_model_dir(tiny_llama)
    backend = HFBackend(BackendOptions(model=md, layer_ids=(2, 4, 5, 7), device="cpu", dtype="float32"))
    batched = backend.capture(SEQS)
    for seq, states in zip(SEQS, batched, strict=True):
        alone = backend.capture([seq])[0]
        for got, want in zip(states, alone, strict=True):
            assert got.shape[0] == len(seq)
            assert got.untyped_storage().nbytes() == len(seq) * md.hidden_size * 4
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_packed_batch_equals_the_plain_path_one_by_one(family, tiny_llama, tiny_deepseek):
    """Samples packed end to end in one row (the GPU default) give each sample the states the plain padded
    path gives it alone: no sample attends to another, positions restart, rows are cut where they belong."""
    md = read_model_dir(tiny_llama if family == "llama" else tiny_deepseek)
    opts = dict(model=md, layer_ids=(2, 4, 5, 7), device="cpu", dtype="float32", compile=False)
    plain = HFBackend(BackendOptions(**opts, packed=False))
    packed = HFBackend(BackendOptions(**opts, packed=True))
    assert packed.packed and not plain.packed
    for seq, states in zip(SEQS, packed.capture(SEQS), strict=True):
        alone = plain.capture([seq])[0]
        for got, want in zip(states, alone, strict=True):
            assert got.shape == (len(seq), md.hidden_size)
            assert got.untyped_storage().nbytes() == len(seq) * md.hidden_size * 4
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=FP32_RTOL)
    packed.close()
    assert plain.decoder.config._attn_implementation != "eagle_ops_packed"  # each model keeps its own


@pytest.mark.parametrize("packed", [False, True])
def test_device_scales_of_each_sample_give_the_writers_facts(packed, tiny_llama):
    """What the GPU path hands the writer (``split_rows`` of a forward's outputs and their ``token_scales``,
    here with a plain clone for the host copy) is each sample's states and exactly the facts the writer would
    compute from them: rows are cut where they belong in both layouts, padding never counted."""
    from pipeline.ondisk import integrity
    from pipeline.backends.base import split_rows

    md = read_model_dir(tiny_llama)
    backend = HFBackend(
        BackendOptions(
            model=md, layer_ids=(2, 4, 5, 7), device="cpu", dtype="float32", compile=False, packed=packed
        )
    )
    with torch.inference_mode():
        outs, rows = backend.forward_layers(SEQS)
        states, scales = split_rows(
            outs, rows, [integrity.layer_profile.token_scales(o) for o in outs], torch.clone
        )
    for seq, sample, sample_scales in zip(SEQS, states, scales, strict=True):
        ids, mask = torch.tensor(seq), torch.ones(len(seq), dtype=torch.long)
        assert [h.shape for h in sample] == [(len(seq), md.hidden_size)] * 4
        assert [rms.shape for rms, _ in sample_scales] == [(len(seq),)] * 4
        assert integrity.written_facts(ids, sample, mask, sample_scales) == integrity.written_facts(
            ids, sample, mask
        )
    backend.close()


@pytest.mark.slow
def test_compiled_packed_batch_equals_the_plain_path_one_by_one(tiny_llama):
    """torch.compile'd layers (the GPU default for long runs) over a packed batch, then a batch of another
    shape (no recompile may change the answer), equal the eager plain path one sample at a time (fp32)."""
    md = read_model_dir(tiny_llama)
    opts = dict(model=md, layer_ids=(2, 4, 5, 7), device="cpu", dtype="float32")
    plain = HFBackend(BackendOptions(**opts, packed=False, compile=False))
    fast = HFBackend(BackendOptions(**opts, packed=True, compile=True))
    assert fast.compiled
    for batch in (SEQS, SEQS[1:]):
        for seq, states in zip(batch, fast.capture(batch), strict=True):
            for got, want in zip(states, plain.capture([seq])[0], strict=True):
                torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=FP32_RTOL)
    fast.close()
    assert "forward" not in fast._layers[0].__dict__  # close() gives the model its eager layers back


def test_compile_is_chosen_for_long_gpu_runs_only():
    """auto compiles on a GPU once 2 x decoder params x planned tokens reach COMPILE_MIN_FLOPS, never on the
    CPU."""
    from pipeline.backends.hf import COMPILE_MIN_FLOPS, should_compile

    params = 10**9
    enough = int(COMPILE_MIN_FLOPS / (2 * params)) + 1
    assert should_compile(None, True, params, enough)
    assert not should_compile(None, True, params, enough // 2)
    assert should_compile(None, True, params, None)  # unknown length: assume long
    assert not should_compile(None, False, params, 10 * enough)
    assert should_compile(True, False, params, 1) and not should_compile(False, True, params, 10 * enough)


def test_compile_auto_credits_an_moe_only_with_the_experts_a_token_meets(tiny_deepseek, tiny_llama):
    """The count the hf backend weighs ``--compile auto`` by, from the loaded model (routed experts fused in
    memory): the tiny DeepSeek's 7 MoE layers x 8 routed experts of 3 x 256 x 128, of which a token meets 2,
    count a quarter; a dense Llama counts whole. A run long enough to compile the same parameters dense is
    not long enough for the MoE."""
    from pipeline.backends.hf import COMPILE_MIN_FLOPS, should_compile

    def counts(model_dir, layer_ids):
        backend = HFBackend(
            BackendOptions(
                model=read_model_dir(model_dir), layer_ids=layer_ids, device="cpu", dtype="float32"
            )
        )
        every = sum(p.numel() for name, p in backend.decoder.named_parameters() if "embed_tokens" not in name)
        met = backend.params_met
        backend.close()
        return every, met

    every, met = counts(tiny_deepseek, (2, 4, 5, 7))
    routed = 7 * 8 * 3 * 256 * 128
    assert met == every - routed + routed // 4
    dense_every, dense_met = counts(tiny_llama, (2, 4, 5, 7))
    assert dense_met == dense_every
    tokens = int(COMPILE_MIN_FLOPS / (2 * met)) - 1  # would compile if every parameter counted
    assert should_compile(None, True, every, tokens) and not should_compile(None, True, met, tokens)
    # an MoE never compiles by default (its compiled loop measured 5x slower), only when asked
    assert not should_compile(None, True, met, 100 * tokens, moe=True)
    assert should_compile(True, True, met, 1, moe=True)


def test_the_pinned_pool_figures_read_torchs_host_allocator_stats():
    """What the hf backend reports of the pinned host pool on a GPU, from torch's host allocator stats
    (microseconds to seconds); the CPU backend reports none (it pins nothing)."""
    from pipeline.backends.hf import pinned_pool

    stats = {"num_host_alloc": 12, "allocated_bytes.peak": 3 << 30, "host_alloc_time.total": 1_250_000}
    assert pinned_pool(stats) == {"blocks_pinned": 12, "peak_bytes": 3 << 30, "pin_seconds": 1.25}
    assert pinned_pool({}) == {"blocks_pinned": 0, "peak_bytes": 0, "pin_seconds": 0.0}


def test_packing_is_left_to_models_whose_heads_flash_attention_takes(tiny_llama, tiny_deepseek):
    """Llama's heads fit flash attention's varlen kernel; an MLA config fits only while its query-key and
    value head sizes are equal (DeepSeek-V3's and the tiny DeepSeek's: 192 and 128)."""
    from transformers import AutoConfig

    from pipeline.backends.hf import flash_fits

    assert flash_fits(AutoConfig.from_pretrained(tiny_llama))
    ds = AutoConfig.from_pretrained(tiny_deepseek)
    assert flash_fits(ds) == (ds.v_head_dim == ds.qk_head_dim)
    ds.v_head_dim = ds.qk_head_dim // 2
    assert not flash_fits(ds)


def test_batch_plan_is_length_bucketed_and_complete():
    """Every sample is planned once; batches respect the token budget; longest first; deterministic."""
    lengths = [5, 100, 37, 100, 3, 64, 64, 12, 90]
    plan = plan_batches(lengths, max_batch_tokens=200, max_batch_size=3)
    flat = [i for b in plan for i in b.indices]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(b.padded_tokens <= 200 or len(b.indices) == 1 for b in plan)
    assert all(len(b.indices) <= 3 for b in plan)
    assert [lengths[b.indices[0]] for b in plan] == sorted(
        (lengths[b.indices[0]] for b in plan), reverse=True
    )
    assert plan == plan_batches(lengths, 200, 3)
    assert pending_batches(plan, set(flat)) == []
    assert pending_batches([Batch((0, 1), 10)], {0}) == [Batch((0, 1), 10)]


def test_extract_output_verifies_and_matches_prepared(extracted_llama, prepared_llama):
    """The extract CLI writes data_0..N-1, data_config.json, sample_lengths.json and a passing
    summary.json."""
    import json

    cfg = formats.read_data_config(extracted_llama)
    assert cfg.num_samples == 24 and cfg.layer_ids == [2, 4, 5, 7] and cfg.dtype == "float32"
    assert formats.existing_data_indices(extracted_llama) == list(range(24))
    summary = json.loads((extracted_llama / "summary.json").read_text())
    assert summary["ok"] is True
    prepared, _ = formats.read_prepared(prepared_llama)
    d = formats.read_sample(extracted_llama / "data_7.pt")
    assert d["input_ids"].tolist() == prepared.ids(7).tolist()
    assert d["loss_mask"].tolist() == prepared.mask(7).tolist()
    assert not list(extracted_llama.glob("*.partial"))
    # the kernels it ran, for verify --model's re-computation (the CPU: eager, unfused)
    assert cfg.extra["compute_path"] == {
        "backend": "hf",
        "compiled": False,
        "fused_norms": False,
        "fused_experts": False,
    }


def test_verify_recomputes_on_the_path_the_extraction_took():
    """An hf set is recomputed with its own compile, fused-norm and fused-experts choices (a set written
    before fused experts were recorded ran transformers' own); a vllm set, or one written before the path was
    recorded, eagerly with the default kernels (never a compile for a few samples)."""
    from pipeline.verify import recompute_kernels

    compiled = {"backend": "hf", "compiled": True, "fused_norms": False, "fused_experts": False}
    fused = {"backend": "hf", "compiled": False, "fused_norms": True, "fused_experts": True}
    older = {"backend": "hf", "compiled": False, "fused_norms": True}
    assert recompute_kernels(compiled) == {"compile": True, "fused_norms": False, "fused_experts": False}
    assert recompute_kernels(fused) == {"compile": False, "fused_norms": True, "fused_experts": None}
    assert recompute_kernels(older) == {"compile": False, "fused_norms": True, "fused_experts": False}
    eager = {"compile": False, "fused_norms": None, "fused_experts": None}
    assert recompute_kernels({"backend": "vllm", "compiled": True}) == eager
    assert recompute_kernels(None) == recompute_kernels("damaged") == eager


def test_killed_run_resumes_to_identical_files(tmp_path, tiny_llama, prepared_llama):
    """SIGKILL mid-way, then --resume: every file is byte-identical to an uninterrupted run, none partial."""
    common = [
        "extract",
        "--prepared",
        prepared_llama,
        "--model",
        tiny_llama,
        "--limit",
        24,
        "--max-batch-size",
        3,
        "--no-progress",
        "--no-verify",
    ]
    reference_dir = tmp_path / "uninterrupted"
    run_pipeline(*common, "--out", reference_dir, check=True)
    out = tmp_path / "states"
    args = [*common, "--out", out]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len(formats.existing_data_indices(out)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = formats.existing_data_indices(out)
    assert 5 <= len(written) < 24, f"kill landed outside the run ({len(written)} files)"
    run_pipeline(*args, "--resume", check=True)
    assert formats.existing_data_indices(out) == list(range(24))
    for i in range(24):
        assert (out / f"data_{i}.pt").read_bytes() == (reference_dir / f"data_{i}.pt").read_bytes(), (
            f"data_{i}.pt differs"
        )
    assert not list(out.glob(".*partial"))


def test_resume_mismatch_names_the_first_key_that_differs(extracted_llama):
    """extract --resume and train's states dir share one rule: the first of formats.RESUME_KEYS that differs,
    with both values; none for the same run."""
    from dataclasses import replace

    found = formats.read_data_config(extracted_llama)
    assert formats.resume_mismatch(found, found) is None
    other = replace(found, dtype="bfloat16", num_samples=7)
    assert formats.resume_mismatch(found, other) == "dtype='float32' but this run has 'bfloat16'"
