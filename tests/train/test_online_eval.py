"""The online-acceptance arithmetic and inputs (pipeline/train/online_eval.py), without vLLM; serving is
test_vllm_draft.py."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.ondisk import formats
from pipeline.errors import StageError
from pipeline.train.online_eval import OnlineConfig, acceptance_from_counters, measure, prompts_of


def test_acceptance_length_is_vllms_definition():
    """Mean acceptance length = 1 + accepted / drafts; per-position rates are per draft."""
    r = acceptance_from_counters(
        {
            "vllm:spec_decode_num_drafts": 27,
            "vllm:spec_decode_num_draft_tokens": 81,
            "vllm:spec_decode_num_accepted_tokens": 36,
            "vllm:spec_decode_num_accepted_tokens_per_pos": [20, 10, 6],
        }
    )
    assert r["acceptance_length"] == pytest.approx(1 + 36 / 27)
    assert r["per_position"] == pytest.approx([20 / 27, 10 / 27, 6 / 27]) and r["draft_tokens"] == 81


def test_no_drafts_gives_no_figure():
    """A run in which vLLM never drafted reports no acceptance length rather than a made-up 1.0."""
    assert acceptance_from_counters({})["acceptance_length"] is None


def test_prompts_stop_before_the_first_assistant_token(make_inputs):
    """Each prompt is the sample's tokens before its first loss-mask position (the conftest masks the first
    4)."""
    inputs = make_inputs(samples=4)
    files = [formats.data_file(inputs.data, i) for i in range(4)]
    prompts = prompts_of(files, limit=3)
    assert len(prompts) == 3
    assert prompts[0] == formats.read_sample(files[0])["input_ids"][:4].tolist()


def _has_vllm() -> bool:
    # a name lookup, not find_spec("vllm"): pytest puts tests/ on sys.path, where tests/vllm is a namespace
    try:
        return importlib.util.find_spec("vllm.entrypoints") is not None
    except ImportError:
        return False


@pytest.mark.skipif(_has_vllm(), reason="vLLM is installed here")
def test_without_vllm_is_a_one_line_error(tmp_path):
    """Asking for the online measurement where vLLM is missing says so in one line, naming the flag."""
    with pytest.raises(StageError) as info:
        measure(OnlineConfig(target=tmp_path, draft=tmp_path), [[1, 2]], tmp_path / "w")
    assert (
        "needs vLLM" in str(info.value) and "--online-eval" in str(info.value) and "\n" not in str(info.value)
    )


def test_a_failed_vllm_run_is_reported_by_its_root_cause():
    """vLLM's worker error is the line shown, not the wrappers that point back at it (seen with an MLA
    target)."""
    from pipeline.train.online_eval import root_cause

    log = "\n".join(
        [
            "INFO 12-01 20:31:05 [core.py:90] Initializing engine",
            (
                "(Worker pid=5241) ERROR 12-01 20:26:23 [multiproc_executor.py:1063] "
                "ValueError: Head dimension 96 is not supported by MLA."
            ),
            "(EngineCore pid=2313) ERROR 12-01 20:26:23 [core.py:1512] "
            "RuntimeError: Worker failed with error 'Head dimension 96 is not supported by MLA.', "
            "please check the stack trace above for the root cause",
            (
                "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
                "See stack trace (above) for the root cause."
            ),
        ]
    )
    assert root_cause(log) == "ValueError: Head dimension 96 is not supported by MLA."
    assert root_cause("RuntimeError: Engine core initialization failed. See root cause above.") == (
        "RuntimeError: Engine core initialization failed. See root cause above."
    )  # only wrappers: the last one
    assert root_cause("killed\n") == "killed"
    # stderr then stdout, as _child joins them: the wrapper on stderr, vLLM's logged cause on stdout (seen
    # with an MLA target + draft before patch 0004)
    wrapper = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    cause = "(EngineCore pid=1) ERROR [core.py:1] ValueError: No common block size for 16 (CPU_MLA: [16]; ..."
    assert root_cause(wrapper + "\n" + cause).startswith("ValueError: No common block size for 16")
