"""verify catches and names each kind of silent corruption planted in a real tiny-model extract.

Every test copies the session's extract (24 files, layers 2, 4, 5, 7 of the tiny Llama), plants one
corruption with the project's own writer, and asserts the check that must name it, with the file and
what is wrong. Each kind has its own check: the test fails when that check is removed.
"""

from __future__ import annotations

import json
import shutil

import torch

from pipeline import verify

from pipeline.ondisk import formats
from pipeline.verify import VerifyConfig
from tests.conftest import run_pipeline, run_extract


def rewrite(d, i, edit):
    """Load data_i.pt, let ``edit`` change its dict in place, write it back with the project's writer."""
    s = formats.read_sample(d / f"data_{i}.pt")
    edit(s)
    formats.write_sample(d / f"data_{i}.pt", s["input_ids"], s["hidden_states"], s["loss_mask"])


def failures(d, **kwargs):
    summary = verify.verify(VerifyConfig(path=d, write_summary=False, **kwargs))
    return summary, {(c.file, c.name): c.detail for c in summary.checks if c.failed}


def test_intact_extract_records_every_checksum_and_passes(extracted_llama):
    """extract leaves one checksums.json with all 24 files (journals folded away) and verify passes it."""
    index = json.loads((extracted_llama / formats.CHECKSUMS).read_text())
    assert index["schema"] == formats.CHECKSUM_SCHEMA and len(index["files"]) == 24
    assert not list(extracted_llama.glob(formats.CHECKSUM_JOURNAL_GLOB))
    assert index["files"]["data_0.pt"]["sha256"] == formats.file_digest(extracted_llama / "data_0.pt").sha256
    summary, failed = failures(extracted_llama)
    assert summary.ok, failed
    by_name = {c.name: c for c in summary.checks if not c.file}
    assert by_name["checksums"].status == "ok" and by_name["layer_order"].status == "ok"


def test_truncated_file_is_named_by_its_checksum(states):
    """A file cut short is reported as truncated, with its size and the size extract wrote."""
    data = (states / "data_3.pt").read_bytes()
    (states / "data_3.pt").write_bytes(data[: len(data) // 2])
    _, failed = failures(states)
    assert (
        failed[("data_3.pt", "checksum")] == f"truncated: {len(data) // 2} bytes, extract wrote {len(data)}"
    )


def test_nan_is_named_with_its_layer(states):
    """A NaN in one layer fails nan_inf for that file, naming the layer id."""
    rewrite(states, 9, lambda s: s["hidden_states"][1].__setitem__((0, 0), float("nan")))
    _, failed = failures(states)
    assert failed[("data_9.pt", "nan_inf")] == "non-finite values: hidden_states[1] (layer 4): 1"


def test_swapped_layers_are_named_by_the_layer_profile(states):
    """A file whose first and last layers were swapped fails layer_order, naming both positions."""

    def swap(s):
        h = s["hidden_states"]
        h[0], h[3] = h[3], h[0]

    rewrite(states, 6, swap)
    _, failed = failures(states)
    detail = failed[("data_6.pt", "layer_order")]
    assert "hidden_states[0] (layer 2) looks like layer 7" in detail
    assert "hidden_states[3] (layer 7) looks like layer 2" in detail
    assert [k for k in failed if k[1] == "layer_order"] == [("data_6.pt", "layer_order")]


def test_dropped_layer_is_named(states):
    """A file missing one layer's tensor fails layers, naming which layer id is missing."""
    rewrite(states, 11, lambda s: s["hidden_states"].pop(1))
    _, failed = failures(states)
    assert failed[("data_11.pt", "layers")] == (
        "3 hidden-state tensors, expected 4: layer 4 missing (the 3 tensors present match layers 2, 5, 7)"
    )


def test_gap_in_numbering_is_named(states):
    """A file renamed out of its place leaves a gap named by contiguity, and the stray file is named as the
    one it was."""
    (states / "data_5.pt").rename(states / "data_30.pt")
    _, failed = failures(states)
    assert failed[(None, "contiguity")] == "missing data_5; unexpected data_30"
    assert (
        failed[("data_30.pt", "renumbered")]
        == "holds the bytes extract wrote as data_5.pt: renamed out of its place"
    )


def test_file_from_another_set_is_named(states, tmp_path, tiny_llama):
    """A well-formed file of another set (other conversations, same model and layers) fails its checksum,
    which says so, besides the prepared-row check."""
    from pipeline.demo.tiny import write_conversations

    other_rows = write_conversations(tmp_path / "other.jsonl", n=4, seed=7)
    run_pipeline(
        "prepare",
        "--data",
        other_rows,
        "--model",
        tiny_llama,
        "--out",
        tmp_path / "op",
        "--seq-length",
        128,
        check=True,
    )
    run_extract(
        tmp_path / "op",
        tiny_llama,
        tmp_path / "os",
        "--no-progress",
        "--no-verify",
        check=True,
    )
    shutil.copy(tmp_path / "os" / "data_2.pt", states / "data_2.pt")
    _, failed = failures(states)
    assert failed[("data_2.pt", "checksum")].startswith(
        "a well-formed sample whose bytes are not what extract wrote: a file from another set"
    )
    assert ("data_2.pt", "prepared_match") in failed


def test_shifted_token_is_named_by_the_spot_recomputation(states, tiny_llama):
    """States shifted by one token against input_ids pass every structural check; recomputing the file
    through the model names the shift. The intact files' recomputation agrees."""

    def shift(s):
        s["hidden_states"] = [torch.cat([h[1:], h[-1:]]).clone() for h in s["hidden_states"]]

    rewrite(states, 4, shift)
    proc = run_pipeline(
        "verify", states, "--model", tiny_llama, "--recompute-samples", 24, "--recompute-seed", 0
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    summary = json.loads((states / "summary.json").read_text())
    recomputed = {c["file"]: c for c in summary["checks"] if c["name"] == "recompute"}
    assert len(recomputed) == 24 and summary["stats"]["recompute"]["seed"] == 0
    bad = recomputed.pop("data_4.pt")
    assert bad["status"] == "fail"
    assert "hidden_states[0] (layer 2) matches the recomputation shifted by +1 token" in bad["detail"]
    # the failed file was computed again beside another sample: the fp32 target is steady, so the states are
    # named as the fault (a random MoE at bf16 is not: tests/pipeline/test_recompute_noise.py)
    own = summary["stats"]["recompute"]["self_difference"]["data_4.pt"]
    assert len(own) == 4 and max(own) < 1e-4
    assert "the states are at fault there" in bad["detail"]
    assert all(c["status"] == "ok" for c in recomputed.values())


def test_layer_order_ignores_neighbours_an_intact_file_cannot_tell_apart():
    """A tensor a little nearer its neighbouring layer's profile (adjacent layers of a shallow random model
    look alike: seen as a false 'layers swapped' on an intact set) is no finding; a first/last swap still
    is."""
    import torch

    from pipeline.model import layer_profile as lp

    torch.manual_seed(0)
    base = [torch.randn(64) for _ in range(3)]
    means = [base[0], base[1], base[1] + 0.3 * base[2], base[2]]  # layers 1 and 2 alike

    def stats(vectors, noise):
        return [lp.LayerStats(float(j) * 0.2, v + noise * torch.randn(64)) for j, v in enumerate(vectors)]

    ref = lp.build_reference([stats(means, 0.3) for _ in range(8)], [2, 4, 5, 7])
    blurred = stats(means, 0.3)
    blurred[1] = lp.LayerStats(0.4, means[2] + 0.3 * torch.randn(64))  # layer 4's tensor looks like layer 5's
    d = [lp.distance(blurred[1], ref, k) for k in range(4)]
    assert d[2] < d[1] - lp.ORDER_MARGIN  # what the per-tensor rule flagged
    assert lp.order_problem(blurred, ref, tokens=64) is None
    intact = stats(means, 0.3)
    swapped = [intact[3], intact[1], intact[2], intact[0]]
    problem = lp.order_problem(swapped, ref, tokens=64)
    assert problem and "hidden_states[0] (layer 2) looks like layer 7" in problem
