"""Which decoder layers are captured, and the two layer-id conventions.

Owns the default layer ids, their validation, and the conversion to vLLM's EAGLE-3 convention
(vLLM captures the INPUT of layer k+1, which is the OUTPUT of layer k).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.errors import StageError

NUM_CAPTURED = 4


def default_layer_ids(num_layers: int) -> list[int]:
    """[2, L//2, L-3, L-1]: three intermediate layers and the last one."""
    if num_layers < 7:
        raise StageError(
            f"model has {num_layers} decoder layers; the default layer ids need at least 7 "
            "(pass --layer-ids explicitly)"
        )
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def validate_layer_ids(ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """Return the layer ids to capture, or raise a one-line StageError saying what is wrong."""
    if ids is None:
        return default_layer_ids(num_layers)
    ids = [int(i) for i in ids]
    problems = []
    if len(ids) != NUM_CAPTURED:
        problems.append(f"exactly {NUM_CAPTURED} ids are needed, got {len(ids)}")
    if len(set(ids)) != len(ids):
        problems.append("ids must be unique")
    if ids != sorted(ids):
        problems.append("ids must be ascending")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        problems.append(f"{bad} out of range 0..{num_layers - 1}")
    if ids and ids[-1] != num_layers - 1:
        problems.append(f"the last id must be the last layer {num_layers - 1}")
    if problems:
        raise StageError(
            f"bad --layer-ids {ids} for a {num_layers}-layer model: {'; '.join(problems)} "
            f"(default: {default_layer_ids(num_layers) if num_layers >= 7 else 'n/a'})"
        )
    return ids


def parse_layer_ids(text: str | None) -> list[int] | None:
    return parse_int_list(text, "--layer-ids")


def parse_int_list(text: str | None, flag: str) -> list[int] | None:
    """Comma-separated integers (spaces allowed) as given to ``flag``; None for no text; else a one-line
    error."""
    if text is None or text.strip() == "":
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise StageError(f"bad {flag} {text!r}: expected comma-separated integers, e.g. 2,16,29,31") from None


def to_vllm_aux_ids(layer_ids: Sequence[int]) -> list[int]:
    """The draft config's ``eagle_aux_hidden_state_layer_ids``: input of layer k+1 for each aux layer k."""
    return [k + 1 for k in layer_ids[:-1]]
