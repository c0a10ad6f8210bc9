"""Pure parts of the vLLM path, without vLLM: the apply script's diff engine, CPU defaults, preflight helpers.

Unmarked: they run in the light environment (`make test-fast`) as well as anywhere else.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.vllm.conftest import REPO


def _load_apply():
    spec = importlib.util.spec_from_file_location("apply_patches", REPO / "patches" / "apply.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


APPLY = _load_apply()


def load_apply():
    return APPLY


PATCH = textwrap.dedent("""\
    pkg 1.0: say hello differently, because the old greeting was wrong.

    --- a/pkg/mod.py
    +++ b/pkg/mod.py
    @@ -2,3 +2,3 @@
     def hello():
    -    return "helo"
    +    return "hello"
     
    """)  # noqa: W293 (the blank context line of a diff is one space)


def write_patch(tmp_path, text=PATCH):
    path = tmp_path / "0001-hello.patch"
    path.write_text(text)
    return load_apply().Patch(path)


def test_patch_parses_header_and_hunks(tmp_path):
    """The header is the prose before '---'; one file, one hunk with old and new lines."""
    patch = write_patch(tmp_path)
    assert patch.header.startswith("pkg 1.0: say hello")
    (hunk,) = patch.files["pkg/mod.py"]
    assert hunk.old_lines == ["def hello():\n", '    return "helo"\n', "\n"]
    assert hunk.new_lines == ["def hello():\n", '    return "hello"\n', "\n"]


def test_hunk_applies_at_a_shifted_position(tmp_path):
    """Context found 3 lines later than the header says still applies, exactly once."""
    apply = load_apply()
    patch = write_patch(tmp_path)
    code = '# a\n# b\n# c\nimport os\ndef hello():\n    return "helo"\n\nx = 1\n'
    out = apply.apply_hunks(code, patch.files["pkg/mod.py"], "mod.py")
    assert out == code.replace('"helo"', '"hello"')


def test_hunk_on_changed_code_raises_naming_the_line(tmp_path):
    """Code that differs from the hunk's context is refused with the file and the first context line."""
    apply = load_apply()
    patch = write_patch(tmp_path)
    with pytest.raises(apply.PatchError, match=r"mod.py: hunk 1 .* near 'def hello\(\):'"):
        apply.apply_hunks("def hello():\n    return 'hi'\n\n", patch.files["pkg/mod.py"], "mod.py")


def test_patch_without_header_is_rejected(tmp_path):
    """A patch must say what it fixes: no prose before '---' is an error."""
    apply = load_apply()
    with pytest.raises(apply.PatchError, match="no header"):
        write_patch(tmp_path, PATCH.split("\n\n", 1)[1])


def test_no_newline_at_end_of_file_marker(tmp_path):
    """'\\ No newline at end of file' strips the newline of the line before it."""
    apply = load_apply()
    text = "pkg 1.0: drop the final newline, for a test of the marker.\n\n" + textwrap.dedent("""\
        --- a/pkg/mod.py
        +++ b/pkg/mod.py
        @@ -1,2 +1,2 @@
         def hello():
        -    return "helo"
        +    return "hello"
        \\ No newline at end of file
        """)
    patch = write_patch(tmp_path, text)
    out = apply.apply_hunks('def hello():\n    return "helo"\n', patch.files["pkg/mod.py"], "mod.py")
    assert out == 'def hello():\n    return "hello"'


def test_cpu_thread_binding_splits_cores_between_ranks():
    """TP ranks get disjoint CPU sets; more ranks than cores is a one-line error."""
    from pipeline.errors import StageError
    from pipeline.runtime.vllm_cpu import thread_binding as cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [3, 2, 1, 0]) == "0,1|2,3"
    assert cpu_thread_binding(1, [0, 1]) == "0,1"
    with pytest.raises(StageError, match="at least that many CPU cores"):
        cpu_thread_binding(3, [0, 1])


def test_cpu_environment_never_overrides_the_operator(monkeypatch):
    """Defaults are filled in only where the operator set nothing."""
    from pipeline.runtime import vllm_cpu

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = vllm_cpu.extraction_environment(1)
    assert env == {"VLLM_MLA_DISABLE": "1"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_cpu.extraction_environment(2)


def test_cpu_engine_arguments_follow_the_cpus_amx_tiles():
    """Where AMX tiles exist every CPU engine gets the reference MLA backend (AMX_MLA takes bf16 weights
    only) and, in bf16, 16-token blocks (the AMX attention kernel kills the worker); elsewhere nothing.
    The ``vllm serve`` flags say the same."""
    from pipeline.runtime import vllm_cpu

    assert vllm_cpu.engine_arguments("bfloat16", amx=False) == {}
    assert vllm_cpu.engine_arguments("float32", amx=True) == {"attention_backend": "CPU_MLA"}
    assert vllm_cpu.engine_arguments("auto", amx=True) == {"attention_backend": "CPU_MLA", "block_size": 16}
    assert vllm_cpu.cli_arguments("bfloat16", amx=True) == [
        "--attention-backend",
        "CPU_MLA",
        "--block-size",
        "16",
    ]
    assert vllm_cpu.cli_arguments("float32", amx=False) == []


def test_checkpoint_layers_against_the_config(tmp_path):
    """The layer rule preflight and the stages share (modeldir.check_layers): wrapper names count, a
    DeepSeek MTP layer declared by num_nextn_predict_layers is no stray layer, an undeclared one is."""
    import json

    from pipeline.errors import StageError
    from pipeline.model.modeldir import check_layers, read_model_dir

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "vocab_size": 16,
                "num_nextn_predict_layers": 1,
            }
        )
    )
    model = read_model_dir(tmp_path)
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in (0, 1, 2)] + [
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]
    check_layers(model, names)  # layer 2 is the declared MTP layer
    with pytest.raises(StageError, match="leaves unused"):
        check_layers(model, [*names, "model.layers.3.mlp.up_proj.weight"])
    with pytest.raises(StageError, match="claims 2 decoder layers"):
        check_layers(model, ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"])


def test_cuda_usable_names_a_driver_older_than_torchs_cuda(monkeypatch):
    """GPUs listed by NVML that torch cannot use (an old driver under a CUDA 13 build) fail 'cuda' naming the
    driver; usable ones pass. (No GPU host with an old driver exists here: torch's answer is stood in.)"""
    import torch

    from pipeline.preflight import cuda_usable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = cuda_usable(8)
    assert result.failed and "8 GPU(s) listed by NVML" in result.detail and "driver >= 580" in result.detail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cuda_usable(8).failed


@pytest.mark.vllm
def test_ngram_baseline_is_vllms_own_prompt_lookup():
    """The offline ngram_context baseline proposes exactly what vLLM's ngram proposer would, on random token
    runs."""
    import random

    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as vllm_lookup,
    )

    from pipeline.train.evaluate import NGRAM_MAX, NGRAM_MIN, ngram_continuations

    rng = random.Random(0)
    for _ in range(200):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        ours = ngram_continuations(toks, 3)
        for length in range(1, len(toks) + 1):
            ref = vllm_lookup(
                np.array(toks[:length], dtype=np.int32), NGRAM_MIN, NGRAM_MAX, 1 << 20, 3
            ).tolist()
            assert ours[length - 1] == ref, (toks[:length], ref, ours[length - 1])
