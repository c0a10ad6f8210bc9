"""The parallel layout rules (pure), the hosts-file keys that configure them, the preflight script built
from a stage's exact argv, and the reading of the preflight's check lines."""

from __future__ import annotations

import shlex

import pytest

from ops.errors import ConfigError
from ops.hosts import HostConfig, host_from_table
from ops.layout import Layout, describe, known, resolve, stage_flags, visible_gpus
from ops.stageargs import parse
from ops.stage import plan_stage, preflight_script, resolve_user, with_layout
from ops.stagecheck import demote, parse_lines


def test_defaults_fit_the_reference_host():
    """Unconfigured: vLLM over all 8 GPUs when the image has vLLM; without it hf, one process per GPU."""
    assert resolve(Layout(), gpus=8, image_has_vllm=True) == Layout("vllm", 8, 1)
    assert resolve(Layout(), gpus=8, image_has_vllm=False) == Layout("hf", 1, 8)
    assert resolve(Layout(), gpus=0, image_has_vllm=False) == Layout("hf", 1, 1)  # a CPU rehearsal


def test_auto_weighs_the_checkpoint_against_one_gpu_as_pipeline_extract_does():
    """With the preflight's sizes, auto follows contract/backends.py: a model that fits one GPU runs on hf,
    one process per GPU; one that does not runs on vLLM over all GPUs; the reason is shown."""
    gib = 2**30
    small = resolve(Layout(), gpus=8, image_has_vllm=True, weights_bytes=3 * gib, gpu_memory_bytes=141 * gib)
    assert small == Layout("hf", 1, 8) and "fits one GPU" in small.reason
    big = resolve(Layout(), gpus=8, image_has_vllm=True, weights_bytes=600 * gib, gpu_memory_bytes=96 * gib)
    assert big == Layout("vllm", 8, 1) and "does not fit one GPU" in big.reason
    assert "does not fit one GPU" in describe(Layout(), big)
    assert (
        resolve(Layout("vllm"), gpus=8, image_has_vllm=True, weights_bytes=3 * gib).reason == "as configured"
    )


def test_auto_names_an_moe_from_the_config_the_preflight_read():
    """The experts come from the config.json the host agent read (its `json` facts, at the model folder's
    path): an MoE that fits one GPU runs on vLLM on a one-GPU host, on hf (one process per GPU) on an
    8-GPU host, whose reason says what is unmeasured."""
    from ops.preflight import model_experts

    host = host_from_table("box", {"host": "box", "model_dir": "/models/m/"}, "f")
    config = {"n_routed_experts": 64, "num_experts_per_tok": 6}
    facts = {"json": {"/models/m/config.json": config, "/data/prepared/metadata.json": {}}}
    assert model_experts(host, facts) == (6, 64)
    assert model_experts(host, {"json": {"/models/m/config.json": None}}) == (0, 0)  # not read: dense
    assert model_experts(host, {}) == (0, 0)
    gib = 2**30
    moe = resolve(
        Layout(),
        gpus=8,
        image_has_vllm=True,
        weights_bytes=18 * gib,
        gpu_memory_bytes=141 * gib,
        experts=(6, 64),
    )
    assert moe == Layout("hf", 1, 8) and "an MoE (6 of 64 experts per token)" in moe.reason
    assert "unmeasured" in describe(Layout(), moe)


def test_hosts_file_and_operator_flags_win_in_that_order():
    """Configured values beat auto; flags after `--` beat the hosts file and are not repeated by ops."""
    assert resolve(Layout("vllm", 4), gpus=8, image_has_vllm=False) == Layout("vllm", 4, 1)
    assert resolve(Layout("hf", 0, 2), gpus=8, image_has_vllm=True) == Layout("hf", 1, 2)
    args = parse(("--backend", "hf", "--data-parallel=3"))
    assert resolve(Layout("vllm", 8), gpus=8, image_has_vllm=True, args=args) == Layout("hf", 1, 3)
    assert stage_flags(Layout("hf", 1, 3), args) == ()
    assert stage_flags(Layout("vllm", 8, 1)) == ("--backend", "vllm", "--tensor-parallel-size", "8")
    assert stage_flags(Layout("vllm", 8, 1), parse(("--tensor-parallel-size", "2"))) == ("--backend", "vllm")


@pytest.mark.parametrize(
    "configured,gpus,extra,words",
    [
        (Layout("vllm", 0, 2), 8, (), "data_parallel 2 with the vllm backend"),
        (Layout("vllm", 16), 8, (), "needs 16 GPUs, the stage sees 8"),
        (Layout("hf", 0, 9), 8, (), "needs 9 GPUs"),
        (Layout(), 8, ("--tensor-parallel-size", "x"), "must be a whole number"),
    ],
)
def test_impossible_layouts_are_refused(configured, gpus, extra, words):
    """More GPUs than the stage sees, data parallelism with vLLM, a non-number: one ConfigError saying so."""
    with pytest.raises(ConfigError, match=words):
        resolve(configured, gpus=gpus, image_has_vllm=True, args=parse(extra))


def test_visible_gpus_follow_docker_gpus_and_known_needs_no_host():
    """`--gpus all|N|device=a,b` decides what the stage sees; a fully configured layout is known up front."""
    assert (
        visible_gpus("all", 8),
        visible_gpus("2", 8),
        visible_gpus('"device=0,3,5"', 8),
        visible_gpus("", 1),
    ) == (8, 2, 3, 1)
    assert known(Layout("vllm", 8)) == Layout("vllm", 8, 1)
    assert known(Layout()) is None and known(Layout("vllm")) is None
    assert known(Layout(), parse(("--backend", "hf", "--data-parallel", "2"))) == Layout("hf", 1, 2)


def test_hosts_file_layout_keys_are_validated():
    """backend/tensor_parallel_size/data_parallel are read from the hosts file; bad values name the key."""
    host = host_from_table("g", {"host": "g", "backend": "vllm", "tensor_parallel_size": 8}, "f")
    assert host.layout == Layout("vllm", 8, 0)
    for key, value in (
        ("backend", "sglang"),
        ("tensor_parallel_size", -1),
        ("data_parallel", "2"),
        ("tensor_parallel_size", True),
    ):
        with pytest.raises(ConfigError, match=key):
            host_from_table("g", {"host": "g", key: value}, "f")


def test_preflight_script_carries_the_stage_argv_exactly():
    """extract: one `pipeline preflight` with its model, data, layout and trust flag, failing fast on any
    check, then the whole stage argv (its `arguments` check); prepare: the model's preflight (hf), failing
    fast only on what prepare refuses on; train: check-args only. One python process each."""
    host = HostConfig(name="h", host="h", docker_gpus="")
    plan = plan_stage(
        host,
        "extract",
        run_id="r",
        layout=Layout("vllm", 8, 1),
        extra_args=("--layer-ids", "1,2,3,4", "--trust-remote-code", "--limit", "3"),
    )
    assert plan.preflight_run[-1] == (
        "python -m pipeline preflight --model /model --prepared /data/prepared "
        "--out /data/hidden_states --backend vllm --layer-ids 1,2,3,4 --tensor-parallel-size 8 "
        "--trust-remote-code --fail-fast-on any -- "
        "extract --prepared /data/prepared --model /model "
        "--out /data/hidden_states --no-progress --backend vllm --tensor-parallel-size 8 "
        "--layer-ids 1,2,3,4 --trust-remote-code --limit 3"
    )
    prepare = plan_stage(host, "prepare", run_id="r")
    assert preflight_script("prepare", prepare.stage_argv) == (
        "python -m pipeline preflight --model /model --backend hf "
        "--fail-fast-on 'arguments,model config,tokenizer,chat template,stage preflight' -- "
        "prepare --data /data/conversations.jsonl --model /model --out /data/prepared"
    )
    assert preflight_script("train", plan_stage(host, "train", run_id="r").stage_argv) == shlex.join(
        (
            "python",
            "-m",
            "pipeline",
            "check-args",
            "train",
            *plan_stage(host, "train", run_id="r").stage_argv[4:],
        )
    )
    for stage in ("prepare", "extract", "weights", "train", "verify"):
        words = shlex.split(preflight_script(stage, plan_stage(host, stage, run_id="r").stage_argv))
        assert words.count("python") == 1 and not {"&", ";", "&&", "|"} & set(words), stage
    run = plan.preflight_run
    assert run[:4] == ("docker", "run", "--rm", "--name") and "eagle-ops.run-id=r" not in " ".join(run)
    assert (
        run[run.index("--user") : run.index("--entrypoint")]
        == plan.docker_run[plan.docker_run.index("--user") : plan.docker_run.index("--entrypoint")]
    )


def test_the_preflight_gets_expert_parallel_from_the_stage_arguments():
    """`-- --expert-parallel` reaches extract's preflight as its own flag, so that an MoE-less model, the hf
    backend or a host without GPUs is refused there, before the server stops; prepare's preflight never
    gets it."""
    host = HostConfig(name="h", host="h", docker_gpus="")
    plan = plan_stage(
        host, "extract", run_id="r", layout=Layout("vllm", 8, 1), extra_args=("--expert-parallel",)
    )
    words = shlex.split(plan.preflight_run[-1])
    before = words[: words.index("--")]
    assert "--expert-parallel" in before and words[-1] == "--expert-parallel"
    prepare_argv = plan_stage(host, "prepare", run_id="r", extra_args=("--expert-parallel",)).stage_argv
    prepare = shlex.split(preflight_script("prepare", prepare_argv))
    assert "--expert-parallel" not in prepare[: prepare.index("--")]


def test_relayout_keeps_user_secrets_and_env_dir():
    """Filling in the layout after the probe changes the flags only: same run id, user, env file."""
    host = HostConfig(name="h", host="h")
    plan = resolve_user(host, plan_stage(host, "extract", run_id="r", secret_names=("HF_TOKEN",)), 1000, 100)
    again = with_layout(host, plan, Layout("hf", 1, 2))
    assert "--data-parallel" in again.stage_argv and again.env_dir == plan.env_dir
    for argv in (again.docker_run, again.preflight_run):
        assert argv[argv.index("--user") + 1] == "1000:100"
    assert again.docker_run[again.docker_run.index("--env-file") + 1].startswith(plan.env_dir)
    assert "--env-file" not in again.preflight_run


def test_check_lines_of_both_output_styles_are_read():
    """`[ 0.12s] fail name: detail` (today's preflight) and `FAIL name: detail` (the rewrite) are both
    checks."""
    got = parse_lines(
        "[  0.01s] ok   model config: Llama\n[  1.20s] fail layer ids: [0, 1] needs 4 ids\n"
        "FAIL vllm patch set: no patch set for 0.31.0\nnoise: not a check\n"
    )
    assert [(c.name, c.status) for c in got] == [
        ("model config", "ok"),
        ("layer ids", "fail"),
        ("vllm patch set", "fail"),
    ]
    assert got[1].detail == "[0, 1] needs 4 ids"


def test_prepare_is_refused_only_by_checks_it_depends_on():
    """For prepare a failed checkpoint check is a warning (it never reads weights); tokenizer still
    refuses."""
    got = demote("prepare", parse_lines("fail checkpoint: permission denied\nfail tokenizer: cannot load\n"))
    assert [(c.name, c.status) for c in got] == [("checkpoint", "warn"), ("tokenizer", "fail")]
    assert demote("extract", parse_lines("fail checkpoint: x"))[0].status == "fail"


def test_the_host_agent_reports_a_checkpoints_weight_bytes(tmp_path):
    """The agent sums the weight files of the model folder (not config or tokenizer files) for the layout's
    rule; a folder it cannot read gives None, not a guess."""
    from ops.host.agent import paths

    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 24)
    (tmp_path / "tokenizer.json").write_bytes(b"{}" * 100)
    (tmp_path / "config.json").write_text("{}")
    facts = paths({"weights": [str(tmp_path), str(tmp_path / "missing")]})
    assert facts["weights"] == {str(tmp_path): 1024, str(tmp_path / "missing"): None}
