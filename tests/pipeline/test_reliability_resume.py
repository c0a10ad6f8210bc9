"""extract --resume skips an existing file only if it belongs to this run (its tokens, its form, its recorded
size and bytes): a file of another sample or another set is refused in one line naming it, nothing changed."""

from __future__ import annotations

import shutil

import pytest

from pipeline.ondisk import formats
from tests.pipeline.test_reliability_readers import cli, refused


def _copy_over(states, src: int, dst: int) -> None:
    shutil.copyfile(
        formats.data_file(states, src), formats.data_file(states, dst)
    )  # a new mtime, as cp gives


def _rewrite(states, i: int, change) -> None:
    """data_i.pt written again with its own tokens and ``change(states list)`` as its hidden states."""
    s = formats.read_sample(formats.data_file(states, i))
    formats.write_sample(
        formats.data_file(states, i), s["input_ids"], change(s["hidden_states"]), s["loss_mask"]
    )


def _unrecorded_other_sample(states) -> None:
    for p in states.glob(formats.CHECKSUM_INDEX_GLOB):  # a set whose index does not know its files
        p.unlink()
    _copy_over(states, 5, 4)


FOREIGN = {
    # case: (how the set is changed, the file named, what is said)
    "another-samples-file-copied-over": (
        lambda s: _copy_over(s, 1, 2),
        "data_2.pt",
        "holds the bytes extract wrote as data_1.pt",
    ),
    "another-sets-file-same-tokens-and-shape": (
        lambda s: _rewrite(s, 3, lambda hs: [h * 2 for h in hs]),
        "data_3.pt",
        "a well-formed sample whose bytes are not what extract wrote",
    ),
    "another-samples-tokens-no-index": (
        _unrecorded_other_sample,
        "data_4.pt",
        "prepared_match: input_ids/loss_mask differ from prepared row 4",
    ),
    "another-dtype": (
        lambda s: _rewrite(s, 6, lambda hs: [h.half() for h in hs]),
        "data_6.pt",
        "hidden_states[0] is float16",
    ),
    "another-layer-count": (
        lambda s: _rewrite(s, 7, lambda hs: hs[:3]),
        "data_7.pt",
        "3 hidden-state tensors, expected 4",
    ),
    "truncated": (
        lambda s: formats.data_file(s, 8).write_bytes(formats.data_file(s, 8).read_bytes()[:300]),
        "data_8.pt",
        "cannot load",
    ),
}


def _snapshot(path):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()}


def _resume(monkeypatch, capsys, prepared, model, states, *flags):
    return cli(
        monkeypatch,
        capsys,
        "extract",
        "--prepared",
        prepared,
        "--model",
        model,
        "--out",
        states,
        "--limit",
        24,
        "--resume",
        "--no-progress",
        *flags,
    )


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_resume_refuses_files_that_are_not_this_runs(
    tmp_path, monkeypatch, capsys, tiny_llama, prepared_llama, extracted_llama, case
):
    """A file --resume would skip that is another sample's, another set's, of another form or damaged: one
    line naming it, what is wrong and --repair / --overwrite, exit 2; nothing in the directory changes."""
    how, name, fragment = FOREIGN[case]
    states = tmp_path / "states"
    shutil.copytree(extracted_llama, states)  # mtimes kept: the set as extract left it
    how(states)
    before = _snapshot(states)
    refused(
        _resume(monkeypatch, capsys, prepared_llama, tiny_llama, states),
        f"{name} is not this run's file",
        fragment,
        "--repair",
        "--overwrite",
    )
    assert _snapshot(states) == before


def test_resume_of_an_intact_set_skips_every_file_and_repair_redoes_a_foreign_one(
    tmp_path, monkeypatch, capsys, tiny_llama, prepared_llama, extracted_llama
):
    """Control: an intact copy resumes with nothing to do, no file rewritten; --repair regenerates a foreign
    file."""
    states = tmp_path / "states"
    shutil.copytree(extracted_llama, states)
    data = {p.name: p.stat().st_mtime_ns for p in states.glob("data_*.pt")}
    rc, err = _resume(monkeypatch, capsys, prepared_llama, tiny_llama, states)
    assert rc == 0, err
    assert {p.name: p.stat().st_mtime_ns for p in states.glob("data_*.pt")} == data
    _copy_over(states, 1, 2)
    rc, err = _resume(monkeypatch, capsys, prepared_llama, tiny_llama, states, "--repair")
    assert rc == 0 and "data_2.pt will be regenerated" in err, err
    assert formats.file_digest(states / "data_2.pt") == formats.file_digest(extracted_llama / "data_2.pt")
