"""Checks of an EAGLE-3 draft checkpoint, for ``pipeline verify``: values, never exit codes.

Owns what makes a trained draft servable and sound: its config parses as speculators' Eagle-3 config,
``eagle_aux_hidden_state_layer_ids`` are in vLLM's convention (the captured layer ids + 1, last layer
excluded), the weights have the shapes the config implies, every float is finite, d2t/t2d are a valid
mapping for a reduced draft vocab and absent for a full one (vLLM refuses a d2t there), and, when the
train run's eval.json is at hand, the draft's offline acceptance beats the trivial baselines. Accepts a
train output dir (uses its draft/), a draft dir, or checkpoints/<epoch>/. It reads; it writes nothing.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.checks import Summary, check, fail, ok, warn
from pipeline.ondisk.readers import read_json
from pipeline.train.files import EVAL, TRAIN_CONFIG

TRAIN_REMEDY = "re-run `pipeline train --overwrite`, or `--resume`"  # a damaged file of a train run


def resolve(path: Path) -> tuple[Path, Path | None]:
    """(checkpoint dir, train output dir or None) for a train dir, draft dir or checkpoints/<epoch> dir."""
    path = Path(path)
    if (path / "draft" / "config.json").is_file():
        return path / "draft", path
    for run_dir in (path.parent, path.parent.parent):
        if (run_dir / TRAIN_CONFIG).is_file():
            return path, run_dir
    return path, None


def _load_weights(ckpt: Path):
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as fh:
        for k in fh.keys():  # noqa: SIM118
            tensors[k] = fh.get_tensor(k)
    return tensors


def _config_checks(ckpt: Path, s: Summary):
    raw = read_json(ckpt / "config.json", TRAIN_REMEDY)
    try:
        from speculators.models.eagle3 import Eagle3SpeculatorConfig

        Eagle3SpeculatorConfig.from_pretrained(str(ckpt))
        s.checks.append(ok("config", "parses as speculators Eagle3SpeculatorConfig"))
    except Exception as exc:  # noqa: BLE001 - any parse failure is the finding
        s.checks.append(fail("config", f"speculators cannot parse config.json: {type(exc).__name__}: {exc}"))
    s.checks.append(
        check(
            "algorithm",
            raw.get("speculators_model_type") == "eagle3",
            "eagle3",
            f"speculators_model_type is {raw.get('speculators_model_type')!r}, not 'eagle3'",
        )
    )
    return raw


def _layer_checks(raw: dict, run_cfg: dict | None, s: Summary) -> None:
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or len(aux) != 3:
        s.checks.append(
            fail("aux_layer_ids", f"eagle_aux_hidden_state_layer_ids is {aux!r}: 3 ids are needed")
        )
        return
    if aux != sorted(set(aux)):
        s.checks.append(
            fail("aux_layer_ids", f"eagle_aux_hidden_state_layer_ids {aux} are not unique and ascending")
        )
        return
    if run_cfg is None:
        s.checks.append(
            warn(
                "aux_layer_ids",
                f"{aux}; no train_config.json beside the checkpoint to compare the capture ids with",
            )
        )
        return
    captured = run_cfg.get("layer_ids") or []
    expected = [k + 1 for k in captured[:-1]]
    s.checks.append(
        check(
            "aux_layer_ids",
            aux == expected,
            f"{aux} = captured layer outputs {captured[:-1]} + 1 (vLLM captures layer inputs)",
            f"{aux} but the hidden states captured the outputs of layers {captured[:-1]}: "
            f"vLLM needs {expected}",
        )
    )


def _weight_checks(ckpt: Path, raw: dict, s: Summary) -> dict:
    import numpy as np
    import torch

    from pipeline.model.vocab import vocab_mapping_problems

    try:
        w = _load_weights(ckpt)
    except Exception as exc:  # noqa: BLE001
        s.checks.append(fail("weights", f"model.safetensors unreadable: {type(exc).__name__}: {exc}"))
        return {}
    layer = raw.get("transformer_layer_config") or {}
    h = int(layer.get("hidden_size", 0))
    v = int(layer.get("vocab_size", 0))
    dv = int(raw.get("draft_vocab_size", 0))
    expected = {
        "fc.weight": (h, 3 * h),
        "lm_head.weight": (dv, h),
        "embed_tokens.weight": (v, h),
        "norm.weight": (h,),
    }
    if dv != v:  # a full-vocab draft has no mapping (speculators stores none, vLLM loads none)
        expected.update({"d2t": (dv,), "t2d": (v,)})
    bad = [
        f"{k} {tuple(w[k].shape) if k in w else 'missing'} != {shape}"
        for k, shape in expected.items()
        if k not in w or tuple(w[k].shape) != shape
    ]
    n_layers = int(layer.get("num_hidden_layers", 1))
    missing_layers = [i for i in range(n_layers) if not any(k.startswith(f"layers.{i}.") for k in w)]
    if missing_layers:
        bad.append(f"decoder layers {missing_layers} missing")
    s.checks.append(
        check(
            "shapes",
            not bad,
            f"hidden {h}, draft vocab {dv}, target vocab {v}, {n_layers} layer(s)",
            "; ".join(bad),
        )
    )
    nonfinite = [k for k, t in w.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    s.checks.append(
        check(
            "finite", not nonfinite, f"{len(w)} tensors, no NaN/Inf", f"NaN/Inf in {', '.join(nonfinite[:5])}"
        )
    )
    if dv == v and "d2t" in w:
        s.checks.append(
            fail(
                "vocab_mapping",
                f"d2t stored although the draft vocab is the target's ({v}): vLLM refuses to load it "
                "(no draft_id_to_target_id in Eagle3LlamaForCausalLM); re-export with `pipeline train`",
            )
        )
    elif "d2t" in w and "t2d" in w:
        problems = vocab_mapping_problems(w["d2t"].numpy().astype(np.int64), w["t2d"].numpy(), dv, v)
        s.checks.append(
            check(
                "vocab_mapping",
                not problems,
                f"d2t/t2d map {dv} draft ids into {v} target ids",
                "; ".join(problems),
            )
        )
    s.stats.update(
        hidden_size=h,
        draft_vocab_size=dv,
        target_vocab_size=v,
        draft_layers=n_layers,
        parameters=int(
            sum(t.numel() for k, t in w.items() if t.is_floating_point() and k != "embed_tokens.weight")
        ),
        dtype=str(w.get("fc.weight", torch.empty(0)).dtype).removeprefix("torch."),
    )
    return w


def _acceptance_checks(run_dir: Path | None, s: Summary) -> None:
    ev_path = run_dir / EVAL if run_dir else None
    if ev_path is None or not ev_path.is_file():
        s.checks.append(warn("acceptance", "no eval.json from the train run: acceptance not measured"))
        return
    ev = read_json(ev_path, TRAIN_REMEDY)
    try:
        draft = float(ev["draft"]["acceptance_length"])
        best = ev["best_baseline"]
        base = float(ev["baselines"][best]["acceptance_length"])
    except (KeyError, TypeError, ValueError) as exc:
        s.checks.append(
            fail("acceptance", f"{ev_path} lacks the acceptance figures ({type(exc).__name__}: {exc})")
        )
        return
    s.checks.append(
        check(
            "acceptance",
            bool(ev["beats_baseline"]),
            f"acceptance length {draft:.3f} > best trivial baseline {best} {base:.3f} "
            f"(k={ev['k']}, {ev['positions']} positions)",
            f"acceptance length {draft:.3f} does not beat the trivial baseline {best} {base:.3f}: "
            "the draft is not usable",
        )
    )
    coverage = ev.get("greedy_in_draft_vocab")
    if coverage is not None:
        s.checks.append(
            ok("draft_vocab_coverage", f"{coverage:.1%} of the target's greedy tokens are in the draft vocab")
            if coverage >= 0.5
            else warn(
                "draft_vocab_coverage",
                f"only {coverage:.1%} of the target's greedy tokens are in the draft vocab: it was chosen "
                "from data the target does not reproduce; "
                "regenerate responses with the target or raise --draft-vocab-size",
            )
        )
    s.stats.update(
        acceptance_length=round(draft, 4),
        baseline=best,
        baseline_acceptance_length=round(base, 4),
        per_position=[round(x, 4) for x in ev["draft"]["per_position"]],
        eval_k=ev["k"],
    )


def verify_checkpoint(path: Path) -> Summary:
    """All checks of a draft checkpoint (train dir, draft dir or checkpoints/<epoch>) as a Summary."""
    ckpt, run_dir = resolve(Path(path))
    s = Summary("checkpoint", str(ckpt))
    for name in ("config.json", "model.safetensors"):
        if not (ckpt / name).is_file():
            s.checks.append(
                fail("files", f"{ckpt / name} missing: not a draft checkpoint (run `pipeline train`)")
            )
            return s
    s.checks.append(ok("files", "config.json, model.safetensors"))
    raw = _config_checks(ckpt, s)
    run_cfg = read_json(run_dir / TRAIN_CONFIG, TRAIN_REMEDY) if run_dir else None
    _layer_checks(raw, run_cfg, s)
    _weight_checks(ckpt, raw, s)
    verifier = Path((raw.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or "")
    s.checks.append(
        ok("verifier", f"{verifier} (the target `vllm serve` of this dir would load)")
        if (verifier / "config.json").is_file()
        else warn("verifier", f"recorded target {verifier} is not present here (pass --model to vllm serve)")
    )
    _acceptance_checks(run_dir, s)
    if run_dir and (run_dir / "summary.json").is_file():
        train = read_json(run_dir / "summary.json", TRAIN_REMEDY).get("train")
        train = train if isinstance(train, dict) else {}
        names = {
            "train_tokens_per_s": "train_tokens_per_s",
            "last_epoch": "train_last_epoch",
            "device": "train_device",
            "world_size": "train_world_size",
        }
        s.stats.update({names[k]: v for k, v in train.items() if k in names})
    return s
