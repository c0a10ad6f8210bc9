"""`pipeline train --states-mode online|hybrid --states-backend vllm` on vLLM 0.32's CPU build: the draft
of a run whose states a vLLM engine produces while it trains, against the offline run on the states
`pipeline extract --backend vllm` wrote from the same prepared set (same steps, seed, fp32); the budget on
disk, the engine's files included; the engine closed on every exit path; SIGINT and SIGKILL mid-run, then
resume.

Tolerance: vLLM computes a sample's states from the tokens scheduled with it in one engine step, and the
CPU matmuls (and, at tensor parallel 2, the all-reduce) round differently for another step's size or
another split (tests/vllm/test_extract_vllm.py holds batched vs one-by-one within 1e-5 per token). The
producer's forwards follow the training order, extract's its own buckets, so a sample's states may differ
in the last bits between the two runs, and the draft trained on them with them. AdamW's step is lr x
m / sqrt(v), whose size does not shrink with the gradient: on a parameter whose gradient is near zero, a
1e-6 relative difference in the states can move a step by a good share of lr (3e-3 here). Asserted: kept
files within the per-token bound of the extract tests (1e-5), the final weights within 1e-3 absolute (a
third of one step), the last training loss within 1e-4 relative, the offline acceptance length at k=3
within the issue's 0.05. Seen (online, tensor parallel 2, against extract at tensor parallel 1): states
7.4e-7, weights 1.1e-4, last loss 2.3e-6 relative, acceptance equal (2.953). An engine at the wrong layer,
a lost sample or a sample's states swapped with another's are O(1) errors in the states and fail all of
these.

Each engine start costs ~15-20 s on 2 cores: one for the offline extract, one per in-process run, three for
the run stopped twice and resumed. Tensor parallel 1 runs the engine in the training process and hands the
states over in memory; tensor parallel 2 (the multi-GPU producer's path) runs worker processes that write
files: the tests take both.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from pipeline.errors import StageError
from pipeline.ondisk import formats
from pipeline.train import states
from tests.conftest import run_pipeline
from tests.train.states_helpers import (
    EPOCHS,
    BytesWatch,
    assert_recovered,
    checkpoint_weights,
    interrupt_then_resume,
    make_stage_inputs,
    states_config,
    still_alive,
    train_losses,
)
from tests.vllm.conftest import compare_dirs, fp32_tolerance
from tests.vllm.scratch_in_states_dir import choose_out

pytestmark = pytest.mark.vllm

TOL = fp32_tolerance()  # per token, kept file against extract's
WEIGHTS_ATOL = 1e-3  # a third of one AdamW step at lr 3e-3 (module docstring)
LOSS_RTOL = 1e-4
ACCEPTANCE_ATOL = 0.05  # issue #31
SHM_SCRATCH = "eagle-vllm-states-*"  # pipeline/backends/vllm_scratch.py SHM_PREFIX
SCRATCH = ".vllm-states-*"  # its PREFIX, in the output dir (pipeline/extract/resume.py VLLM_SCRATCH_GLOB)
WRAPPER = "tests.vllm.scratch_in_states_dir"


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


def scratch_dirs(data: Path) -> set[Path]:
    return set(Path(data).glob(SCRATCH)) | set(Path("/dev/shm").glob(SHM_SCRATCH))


def tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: started once for this process by the first spawn, it lives as
    long as this process (it is not the engine's)."""
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def engine_spy(monkeypatch, tmp_path):
    """What the stage's backend started, seen right after the stage built it: its name, how it hands the
    states over, the processes it added to this one (the engine's) and its scratch folders; and whether the
    stage closed it."""
    import pipeline.backends as backends
    import pipeline.extract.stage  # noqa: F401 - imported now, it binds the real get_backend, not the spy (a
    # first import during the patched test kept the spy for every later test of the session)

    real = backends.get_backend
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    before_dirs = scratch_dirs(tmp_path / "states")
    seen: dict = {}

    def spy(name, options):
        backend = real(name, options)
        close = backend.close

        def closing() -> None:
            seen["closed"] = True
            close()

        backend.close = closing
        seen["name"], seen["handoff"] = name, backend.handoff
        seen["pids"] = [p.pid for p in me.children(recursive=True) if p.pid not in before and not tracker(p)]
        seen["scratch"] = scratch_dirs(tmp_path / "states") - before_dirs
        return backend

    monkeypatch.setattr(backends, "get_backend", spy)
    return seen


def assert_engine_closed(seen: dict) -> None:
    """The stage closed the engine; its processes (tensor parallel > 1: its workers, the files hand-over)
    and its scratch folder are gone."""
    assert seen["name"] == "vllm" and seen["closed"] and seen["scratch"], seen
    assert bool(seen["pids"]) == (seen["handoff"] == "files"), seen
    assert not still_alive(seen["pids"], within=15), "the engine's processes outlived the run"
    assert not [d for d in seen["scratch"] if d.exists()], seen["scratch"]


def assert_close_to_offline(cfg, summary: dict, offline: dict) -> dict:
    """Kept files within the extract tests' per-token bound of extract's; the final weights, the last loss
    and the acceptance within the module docstring's bounds; returns the figures seen."""
    ref = offline["cfg"]
    kept = formats.existing_data_indices(cfg.data)
    want = cfg.out.parent / "extract-kept"  # the offline set's files of the same samples, side by side
    want.mkdir()
    for i in kept:
        formats.data_file(want, i).write_bytes(formats.data_file(ref.data, i).read_bytes())
    files = compare_dirs(cfg.data, want)
    a, b = checkpoint_weights(ref.out, EPOCHS - 1), checkpoint_weights(cfg.out, EPOCHS - 1)
    assert a.keys() == b.keys()
    weights = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    la, lb = train_losses(ref.out)[-1], train_losses(cfg.out)[-1]
    ours, theirs = (s["eval"]["draft"]["acceptance_length"] for s in (summary, offline["summary"]))
    seen = {
        "states": max(files["worst_per_layer"]),
        "weights": weights,
        "loss": (la, lb),
        "al": (ours, theirs),
    }
    print(f"vllm producer against offline: {seen}")  # the figures the module docstring quotes (pytest -s)
    assert max(files["worst_per_layer"]) < TOL, seen
    assert weights < WEIGHTS_ATOL, seen
    assert abs(la - lb) <= LOSS_RTOL * abs(la), seen
    assert abs(ours - theirs) <= ACCEPTANCE_ATOL, seen
    return seen


def assert_verified(data: Path) -> None:
    from pipeline import verify

    assert not [c for c in verify.verify(verify.VerifyConfig(path=data)).checks if c.status == "fail"]


def test_online_with_the_engines_files_in_the_states_dir(
    stage_inputs, offline, tmp_path, monkeypatch, engine_spy
):
    """online, tensor parallel 2, the engine's per-request files in the states dir (as with no room in
    /dev/shm): the draft is the
    offline one within the stated tolerance, the state files and the engine's files together never exceed
    the budget, the kept files pass `pipeline verify`, and the engine and its folder are gone at the end."""
    from pipeline.backends import vllm_scratch
    from pipeline.train.stage import run

    monkeypatch.setattr(vllm_scratch, "choose", choose_out)
    cfg = vllm_config(
        stage_inputs,
        tmp_path,
        states_mode="online",
        states_budget=budget(stage_inputs, 8),
        states_tensor_parallel_size=2,  # worker processes: the states come as files
    )
    with BytesWatch(cfg.data) as watch:
        summary = run(cfg, log=lambda m: None)
    st = summary["train"]["states"]
    assert watch.max <= int(cfg.states_budget) and st["peak_bytes"] <= int(cfg.states_budget)
    assert [d.parent for d in engine_spy["scratch"]] == [cfg.data] and engine_spy["handoff"] == "files"
    assert st["produced_samples"] == 4 + 12 + 8 * (EPOCHS - 1)  # the 8 kept are produced once
    assert formats.read_data_config(cfg.data).backend == "vllm"
    assert_engine_closed(engine_spy)
    assert_verified(cfg.data)
    assert_close_to_offline(cfg, summary, offline)


def test_hybrid_reuses_what_it_keeps(stage_inputs, offline, tmp_path, engine_spy):
    """hybrid, batched forwards, tensor parallel 1 (the engine in this process, the states handed over in
    memory): the kept training samples are produced
    once, the others each epoch, the budget holds, verify passes, the draft is the offline one within the
    stated tolerance, and the engine is closed."""
    from pipeline.train.stage import run

    cfg = vllm_config(stage_inputs, tmp_path, states_mode="hybrid", states_budget=budget(stage_inputs, 11))
    with BytesWatch(cfg.data) as watch:
        summary = run(cfg, log=lambda m: None)
    st = summary["train"]["states"]
    kept_train = len(formats.existing_data_indices(cfg.data)) - 4
    assert 4 < kept_train < 12
    assert st["produced_samples"] == 4 + 12 + (12 - kept_train)
    assert watch.max <= int(cfg.states_budget) and st["peak_bytes"] <= int(cfg.states_budget)
    assert_engine_closed(engine_spy)
    assert_verified(cfg.data)
    assert_close_to_offline(cfg, summary, offline)


def test_a_failing_producer_closes_the_engine(stage_inputs, tmp_path, monkeypatch, engine_spy):
    """The disk fails under the producer (its third file): the run ends in the producer's one-line error,
    and the engine's processes and folder are gone, no partial file left."""
    from pipeline.train.stage import run

    real, calls = formats.write_sample, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(formats, "write_sample", failing)
    cfg = vllm_config(stage_inputs, tmp_path, states_mode="online", states_budget="50M")
    with pytest.raises(StageError, match="writing states to .* No space left on device"):
        run(cfg, log=lambda m: None)
    assert_engine_closed(engine_spy)
    assert not list(cfg.data.glob(".*partial"))


def test_sigint_then_sigkill_then_resume(stage_inputs, offline, tmp_path):
    """A hybrid `pipeline train` process, tensor parallel 2, the engine's files in the states dir: SIGINT in
    epoch 0 (as
    Ctrl-C) ends it with 130, its engine and folder gone; resumed, then SIGKILLed in epoch 1 (the process
    alone), the killed run's folder is left, then removed by the next --resume, which ends the run from the
    last checkpoint: no step trained twice, the budget never exceeded, the kept files reused and verified,
    the draft the offline one within the stated tolerance."""
    ref = offline["cfg"]
    steps = offline["summary"]["train"]["steps_per_epoch"]
    cfg = vllm_config(
        stage_inputs,
        tmp_path,
        states_mode="hybrid",
        states_budget=budget(stage_inputs, 8, extra_samples=4),
        states_tensor_parallel_size=2,  # worker processes, files in the states dir
        states_max_batch_size=1,
        checkpoint_steps=1,
    )
    result = interrupt_then_resume(
        cfg, [(signal.SIGINT, 2), (signal.SIGKILL, steps + 2)], timeout=600, module=WRAPPER
    )
    interrupted, killed = result["stops"]
    assert interrupted["proc"].returncode == 130, interrupted["proc"].stderr_text[-2000:]
    assert interrupted["children"] and not still_alive(interrupted["children"], within=15)
    assert not [n for n in interrupted["left"] if n.startswith(".vllm-states-")], interrupted["left"]
    assert killed["proc"].returncode == -signal.SIGKILL and steps + 2 <= killed["rows"] < EPOCHS * steps
    # the engine's processes do not watch their parent: the stage's watchdog (pipeline/train/reaper.py) ends
    # them; without it they outlived the kill
    orphans = still_alive(killed["children"], within=30)
    for pid in orphans:  # not to leave them to the next test; the assertion says they outlived the trainer
        psutil.Process(pid).kill()
    assert not orphans, "the engine's processes outlived the SIGKILLed trainer"
    assert [n for n in killed["left"] if n.startswith(".vllm-states-")], killed["left"]  # left by the kill
    summary = assert_recovered(cfg, result, EPOCHS * steps)
    assert not list(cfg.data.glob(SCRATCH)), "a killed run's engine folder was left in the states dir"
    assert summary["train"]["states"]["produced_samples"] < 12
    a, b = checkpoint_weights(ref.out, EPOCHS - 1), checkpoint_weights(cfg.out, EPOCHS - 1)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < WEIGHTS_ATOL
    la, lb = train_losses(ref.out)[-1], train_losses(cfg.out)[-1]
    assert abs(la - lb) <= LOSS_RTOL * abs(la), (la, lb)
