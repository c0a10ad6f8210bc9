"""The train stage with produced states (`[hosts.NAME.train]`): the table's validation, the exact flags and
environment of the stage container, the refusals of what `pipeline train` cannot run, the preflight's GPU
count check and `remote-train --dry-run`. Pure: nothing connects."""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import replace

import pytest

from ops_helpers import REPO, write_hosts
from ops.errors import ConfigError
from ops.gpus import Gpu, GpuState, ServerFacts
from ops.hosts import HostConfig, load_hosts_file
from ops.preflight import FAIL, OK, split_check
from ops.stage import LABEL_RUN, LABEL_STAGE, plan_stage, resolve_user
from ops.trainsplit import STATES_DIR, TrainStates

HYBRID = {"states_mode": "hybrid", "states_budget": "2T"}


def load(tmp_path, **train) -> HostConfig:
    return load_hosts_file(write_hosts(tmp_path / "h.toml", "box", host="h", train=train))["box"]


def box(train: TrainStates, **kw) -> HostConfig:
    base = dict(
        name="box", host="box", data_root="/srv/d", model_dir="/srv/m", cache_dir="/srv/c", image="i:1"
    )
    return HostConfig(**{**base, **kw}, train=train)


def env_of(argv: tuple[str, ...]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, w in enumerate(argv) if w == "--env")


def flag(argv: tuple[str, ...], name: str) -> str:
    (at,) = [i for i, w in enumerate(argv) if w == name]  # exactly once
    return argv[at + 1]


def test_table_is_read_and_offline_is_the_default(tmp_path):
    assert HostConfig(name="d", host="d").train == TrainStates()
    assert load(tmp_path, states_mode="offline").train == TrainStates()
    cfg = load(tmp_path, **HYBRID, states_backend="hf", producer_gpus=[5], trainer_gpus=[2])
    assert cfg.train == TrainStates("hybrid", "2T", "hf", (5,), (2,))
    assert cfg.train.gpus == (5, 2) and not cfg.train.shared
    shared = load(tmp_path, states_mode="online", states_budget="64GiB", gpus="shared", memory_share=0.8)
    assert shared.train.shared and shared.train.memory_share == 0.8 and shared.train.states_budget == "64GiB"


@pytest.mark.parametrize(
    "train, message",
    [
        ({"states_mode": "streaming"}, "states_mode must be one of offline, online, hybrid"),
        ({"states_mode": "offline", "states_budget": "2T"}, "states_budget: only with states_mode online"),
        ({"states_mode": "hybrid"}, "states_budget must be a size"),
        ({"states_mode": "hybrid", "states_budget": "2X"}, "states_budget must be a size"),
        ({"states_mode": "hybrid", "states_budget": "0G"}, "states_budget must be a size"),
        ({**HYBRID, "states_backend": "trt"}, "states_backend must be one of hf, vllm"),
        ({**HYBRID, "producer_gpus": [0, 1], "trainer_gpus": [1, 2]}, "share GPU 1: list disjoint"),
        ({**HYBRID, "producer_gpus": [0, 0], "trainer_gpus": [1]}, r"names a GPU twice"),
        ({**HYBRID, "producer_gpus": [-1], "trainer_gpus": [1]}, "list of GPU indices"),
        ({**HYBRID, "producer_gpus": [], "trainer_gpus": [1]}, "non-empty list"),
        ({**HYBRID, "producer_gpus": [0]}, "producer_gpus needs train.trainer_gpus too"),
        ({**HYBRID, "gpus": "shared", "trainer_gpus": [1]}, "give one or the other"),
        ({**HYBRID, "gpus": "all"}, 'gpus must be "shared"'),
        ({**HYBRID, "gpus": "shared", "memory_share": 1.0}, r"between 0 and 1 \(exclusive\), got 1.0"),
        ({**HYBRID, "gpus": "shared", "memory_share": 0}, "between 0 and 1"),
        ({**HYBRID, "memory_share": 0.5}, 'with gpus = "shared" only'),
        ({**HYBRID, "budget": "2T"}, "unknown train key"),
        ({**HYBRID, "trainers": 0}, "trainers must be a whole number of trainer processes >= 1, got 0"),
        ({**HYBRID, "trainers": "8"}, "trainers must be a whole number"),
        ({**HYBRID, "trainers": True}, "trainers must be a whole number"),
        (
            {**HYBRID, "producer_gpus": [0], "trainer_gpus": [1, 2], "trainers": 2},
            "with train.trainer_gpus there",
        ),
    ],
)
def test_bad_train_tables_are_one_line_errors(tmp_path, train, message):
    with pytest.raises(ConfigError, match=message) as err:
        load(tmp_path, **train)
    assert "\n" not in str(err.value) and "[hosts.box]" in str(err.value)


def test_split_plan_exact_flags_environment_and_labels():
    """Producer on host GPU 5, trainer on host GPU 2: the container sees both in PCI bus order (the numbering
    gpu-status shows), the producer first (cuda:0), the trainer second (cuda:1); the states dir replaces the
    finished extract set as --data and is not a preflight input; the container carries the run-id label
    gpu-clean and the lock read, so every process of the mode (all inside it) is known as this stage's."""
    h = box(TrainStates("hybrid", "2T", "hf", (5,), (2,)))
    plan = plan_stage(h, "train", run_id="t1")
    assert plan.stage_argv == (
        *("python", "-m", "pipeline", "train"),
        *("--data", STATES_DIR, "--verifier", "/data/verifier", "--prepared", "/data/prepared"),
        *("--model", "/model", "--out", "/data/train"),
        *("--states-mode", "hybrid", "--states-budget", "2T", "--states-backend", "hf"),
        *("--states-device", "cuda:0", "--device", "cuda:1"),
    )
    assert plan.host_inputs == ("/srv/d/verifier", "/srv/d/prepared")  # no hidden_states to find
    env = env_of(plan.docker_run)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,2" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert (
        env_of(plan.preflight_run)["CUDA_VISIBLE_DEVICES"] == "5,2"
    )  # the preflight sees what the stage sees
    assert flag(plan.docker_run, "--name") == "eagle-t1" and flag(plan.docker_run, "--gpus") == "all"
    labels = [plan.docker_run[i + 1] for i, w in enumerate(plan.docker_run) if w == "--label"]
    assert f"{LABEL_RUN}=t1" in labels and f"{LABEL_STAGE}=train" in labels
    script = plan.docker_run[-1]
    assert shlex.split(script)[: len(plan.stage_argv)] == list(plan.stage_argv)
    assert (
        "pipeline check-args train" in plan.preflight_run[-1]
        and "--states-budget 2T" in plan.preflight_run[-1]
    )
    # a later replan (the preflight's user) renders the same split
    again = resolve_user(h, plan, 1000, 100)
    assert again.train == plan.train and env_of(again.docker_run)["CUDA_VISIBLE_DEVICES"] == "5,2"


def test_shared_plans_and_operator_flags_win():
    """Shared: hf producer and trainer on cuda:0, no CUDA_VISIBLE_DEVICES (every GPU docker gives); the vllm
    engine takes every visible GPU, so no --states-device (it refuses cuda:N). Flags given after `--` are
    left out of ours, and the operator's --data is the states dir."""
    hf = plan_stage(box(TrainStates("online", "140G")), "train", run_id="t2")
    assert flag(hf.stage_argv, "--states-device") == "cuda:0" and flag(hf.stage_argv, "--device") == "cuda:0"
    assert "CUDA_VISIBLE_DEVICES" not in env_of(hf.docker_run)
    vllm = plan_stage(box(TrainStates("online", "140G", "vllm")), "train", run_id="t3")
    assert "--states-device" not in vllm.stage_argv and flag(vllm.stage_argv, "--states-backend") == "vllm"
    assert "--states-memory-share" not in vllm.stage_argv  # pipeline train's own rule decides
    assert any("pipeline train's share of each GPU's memory" in line for line in vllm.train.why)
    assert any("tensor parallel over all, in a process of its own)" in line for line in vllm.train.why)
    held = plan_stage(box(TrainStates("online", "140G", "vllm", memory_share=0.45)), "train", run_id="t3b")
    assert flag(held.stage_argv, "--states-memory-share") == "0.45"
    assert any(
        "held to 0.45 of each GPU's memory (hosts file: train.memory_share)" in w for w in held.train.why
    )
    mine = plan_stage(
        box(TrainStates("hybrid", "2T", "hf", (0,), (1,))),
        "train",
        run_id="t4",
        extra_args=("--device", "cpu", "--states-device=cpu", "--data", "/data/mine"),
    )
    assert mine.stage_argv.count("--device") == 1 and flag(mine.stage_argv, "--device") == "cpu"
    assert "--states-device" not in mine.stage_argv and "--states-device=cpu" in mine.stage_argv
    assert mine.train.data == "/data/mine" and mine.stage_argv[5] == "/data/mine"
    assert any("yours after `--` win: --states-device, --device" in line for line in mine.train.why)


def test_vllm_producer_split_over_several_gpus():
    """A vllm producer on host GPUs 0-5 and the trainer on host GPU 7: the container sees the six then the
    trainer's, the engine spans the first six (--states-tensor-parallel-size 6, its workers take cuda:0..5),
    the trainer takes the one after them (cuda:6); no --states-device (the engine refuses cuda:N). An
    operator's own tensor parallel size after `--` wins."""
    six = TrainStates("hybrid", "2T", "vllm", (0, 1, 2, 3, 4, 5), (7,))
    plan = plan_stage(box(six), "train", run_id="t9")
    assert flag(plan.stage_argv, "--states-tensor-parallel-size") == "6"
    assert flag(plan.stage_argv, "--device") == "cuda:6" and "--states-device" not in plan.stage_argv
    env = env_of(plan.docker_run)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,7" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    (split,) = [line for line in plan.train.why if line.startswith("GPUs split")]
    assert "the vLLM engine tensor parallel 6 on host GPUs 0, 1, 2, 3, 4, 5 (cuda:0..5" in split
    assert "(cuda:0..5 in the container, in a process of its own;" in split  # pipeline train's default
    assert "the trainer on host GPU 7 (cuda:6)" in split
    one = plan_stage(box(TrainStates("online", "1T", "vllm", (3,), (1,))), "train", run_id="t10")
    assert flag(one.stage_argv, "--states-tensor-parallel-size") == "1"
    assert flag(one.stage_argv, "--device") == "cuda:1"
    mine = plan_stage(box(six), "train", run_id="t11", extra_args=("--states-tensor-parallel-size", "4"))
    assert mine.stage_argv.count("--states-tensor-parallel-size") == 1
    assert flag(mine.stage_argv, "--states-tensor-parallel-size") == "4"


def test_several_trainer_gpus_make_a_torchrun_job():
    """The hf producer on host GPU 6 and the trainer on host GPUs 2, 3 and 7: the stage is a torchrun job of
    three `pipeline train` processes (rank r on cuda:r, so the trainers' GPUs come first in the container's
    order), the producer on cuda:3 in rank 0's process; no --device (each rank's is its local rank);
    --dry-run's lines say so."""
    plan = plan_stage(box(TrainStates("online", "500G", "hf", (6,), (2, 3, 7))), "train", run_id="t12")
    launcher = ("python", "-m", "pipeline.runtime.torchrun", "--standalone", "--nproc-per-node", "3")
    assert plan.stage_argv[: len(launcher) + 3] == (*launcher, "-m", "pipeline", "train")
    assert flag(plan.stage_argv, "--states-device") == "cuda:3" and "--device" not in plan.stage_argv
    assert env_of(plan.docker_run)["CUDA_VISIBLE_DEVICES"] == "2,3,7,6"
    assert shlex.split(plan.docker_run[-1])[: len(plan.stage_argv)] == list(plan.stage_argv)
    check = plan.preflight_run[-1]  # the preflight checks the stage's own arguments, not torchrun's
    assert f"pipeline check-args train --data {STATES_DIR} " in check and "nproc" not in check
    (split,) = [line for line in plan.train.why if line.startswith("GPUs split")]
    assert "the hf producer on host GPU 6 (cuda:3 in the container, in rank 0's process)" in split
    assert "data parallel over host GPUs 2, 3, 7 (cuda:0..2: torchrun" in split
    assert any("torchrun's agent and its 3 trainer processes" in line for line in plan.train.why)
    one = plan_stage(box(TrainStates("online", "500G", "hf", (6,), (2,))), "train", run_id="t13")
    assert one.stage_argv[:4] == ("python", "-m", "pipeline", "train")  # one trainer GPU: no torchrun


def test_several_trainers_on_shared_gpus_are_a_torchrun_job_beside_the_engine(tmp_path):
    """The Kimi plan's first split: `gpus = "shared"`, `trainers = 8`: a torchrun job of 8 ranks on cuda:0..7
    and the vLLM engine tensor parallel over every GPU the container sees, in a process of rank 0's own, held
    to the memory share; no --device (each rank's is its local rank). With hf, the producer on cuda:0 in
    rank 0's process."""
    cfg = load(tmp_path, **HYBRID, states_backend="vllm", gpus="shared", memory_share=0.7, trainers=8)
    assert cfg.train.trainers == 8 and cfg.train.data_parallel
    plan = plan_stage(cfg, "train", run_id="t15")
    launcher = ("python", "-m", "pipeline.runtime.torchrun", "--standalone", "--nproc-per-node", "8")
    assert plan.stage_argv[: len(launcher) + 3] == (*launcher, "-m", "pipeline", "train")
    assert flag(plan.stage_argv, "--states-memory-share") == "0.7"
    assert "--device" not in plan.stage_argv and "--states-device" not in plan.stage_argv
    assert "CUDA_VISIBLE_DEVICES" not in env_of(plan.docker_run)
    (split,) = [line for line in plan.train.why if line.startswith("GPUs shared")]
    assert "tensor parallel over all, in a process of rank 0's own), held to 0.7" in split
    assert "the trainer data parallel over cuda:0..7 beside it (torchrun" in split
    hf = plan_stage(box(TrainStates("online", "1T", "hf", trainers=2)), "train", run_id="t16")
    assert flag(hf.stage_argv, "--states-device") == "cuda:0" and "--device" not in hf.stage_argv
    assert hf.stage_argv[:6] == launcher[:5] + ("2",)


def test_a_vllm_producer_beside_several_trainer_gpus():
    """The Kimi plan's split: the vLLM engine tensor parallel 6 on host GPUs 0-5 and the trainer on host GPUs
    6 and 7: a torchrun job of two ranks on cuda:0 and cuda:1 (the trainers' GPUs first in the container's
    order), the engine on cuda:2..7 in a process of rank 0's own; --dry-run's lines say so."""
    plan = plan_stage(
        box(TrainStates("hybrid", "2T", "vllm", (0, 1, 2, 3, 4, 5), (6, 7))), "train", run_id="t14"
    )
    launcher = ("python", "-m", "pipeline.runtime.torchrun", "--standalone", "--nproc-per-node", "2")
    assert plan.stage_argv[: len(launcher) + 3] == (*launcher, "-m", "pipeline", "train")
    assert flag(plan.stage_argv, "--states-tensor-parallel-size") == "6"
    assert "--states-device" not in plan.stage_argv and "--device" not in plan.stage_argv
    assert env_of(plan.docker_run)["CUDA_VISIBLE_DEVICES"] == "6,7,0,1,2,3,4,5"
    (split,) = [line for line in plan.train.why if line.startswith("GPUs split")]
    assert "the vLLM engine tensor parallel 6 on host GPUs 0, 1, 2, 3, 4, 5 (cuda:2..7" in split
    assert "in a process of rank 0's own" in split and "data parallel over host GPUs 6, 7" in split


def test_offline_train_plan_is_unchanged():
    """Without a train table the train stage reads the finished extract set, as before."""
    plan = plan_stage(box(TrainStates()), "train", run_id="t5")
    assert plan.train is None and flag(plan.stage_argv, "--data") == "/data/hidden_states"
    assert "--states-mode" not in plan.stage_argv and "/srv/d/hidden_states" in plan.host_inputs
    assert "CUDA_VISIBLE_DEVICES" not in env_of(plan.docker_run)


@pytest.mark.parametrize(
    "train, kw, message",
    [
        (
            TrainStates("hybrid", "2T", "hf", (0, 1, 2, 3, 4, 5), (6,)),
            {},
            "hf states backend produces on one",
        ),
        (
            TrainStates("hybrid", "2T", "hf", (0,), (6, 7)),
            {"docker_gpus": "device=0,6,7"},
            'docker_gpus = "all"',
        ),
        (
            TrainStates("hybrid", "2T", "vllm", (0, 1), (2,)),
            {"docker_gpus": "device=0,1,2"},
            'docker_gpus = "all"',
        ),
        (TrainStates("hybrid", "2T", "hf", memory_share=0.8), {}, "the hf backend produces here; remove it"),
        (TrainStates("hybrid", "2T", "hf", (0,), (1,)), {"docker_gpus": "device=0,1"}, 'docker_gpus = "all"'),
    ],
)
def test_splits_pipeline_train_cannot_run_are_refused(train, kw, message):
    """What today's pipeline train cannot run: an hf producer on several GPUs, a host split without the
    host's GPU numbering, a memory share for the hf producer: ops refuses (exit 2) before anything
    connects."""
    with pytest.raises(ConfigError, match=message) as err:
        plan_stage(box(train, **kw), "train", run_id="t6")
    assert "\n" not in str(err.value)


def _gpus(n: int) -> GpuState:
    gpu = Gpu(0, "NVIDIA H200", "GPU-0", 0, 143771, "v2", 0, 0, ())
    none = ServerFacts("none")
    return GpuState(
        "box", "box", tuple(replace(gpu, index=i) for i in range(n)), (), (), None, None, none, ()
    )


def test_preflight_checks_the_split_against_the_hosts_gpus():
    """The host's GPU count is known only once probed: a split naming GPU 7 on a 2-GPU host fails the
    preflight (nothing is stopped), passes on 8; a shared plan has nothing to check."""
    plan = plan_stage(box(TrainStates("hybrid", "2T", "hf", (0,), (7,))), "train", run_id="t7")
    bad = split_check(plan, _gpus(2))
    assert (
        bad.status == FAIL
        and bad.detail == "train.producer_gpus/trainer_gpus name GPU 7, the host has 2 (0..1)"
    )
    assert split_check(plan, _gpus(8)).status == OK
    shared = plan_stage(box(TrainStates("online", "1T")), "train", run_id="t8")
    assert split_check(shared, _gpus(2)) is None
    eight = plan_stage(box(TrainStates("online", "1T", "vllm", trainers=8)), "train", run_id="t8b")
    assert (
        split_check(eight, _gpus(4)).detail
        == "train.trainers 8: one trainer process per GPU, and the host has 4"
    )
    assert split_check(eight, _gpus(8)).status == OK


def dry_run(hosts) -> subprocess.CompletedProcess:
    """``ops remote-train --host box --dry-run`` with this hosts file, as an operator runs it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ops",
            "remote-train",
            "--host",
            "box",
            "--hosts-file",
            str(hosts),
            "--dry-run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_remote_train_dry_run_prints_the_split_and_why(tmp_path):
    hosts = write_hosts(
        tmp_path / "h.toml",
        "box",
        host="gpu-box.invalid",
        train={**HYBRID, "producer_gpus": [3], "trainer_gpus": [0]},
    )
    res = dry_run(hosts)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "plan train on box" in out and "--states-mode hybrid --states-budget 2T" in out
    assert (
        "the hf producer on host GPU 3 (cuda:0 in the container), the trainer on host GPU 0 (cuda:1)" in out
    )
    assert "CUDA_VISIBLE_DEVICES=3,0" in out
    assert "all run in container eagle-train-" in out and "dry run: nothing was checked" in out
    tp = write_hosts(
        tmp_path / "tp.toml",
        "box",
        host="gpu-box.invalid",
        train={**HYBRID, "states_backend": "vllm", "producer_gpus": [0, 1, 2, 3], "trainer_gpus": [4]},
    )
    res = dry_run(tp)
    assert res.returncode == 0, res.stderr
    assert "--states-backend vllm --states-tensor-parallel-size 4 --device cuda:4" in res.stdout
    assert "the vLLM engine tensor parallel 4 on host GPUs 0, 1, 2, 3" in res.stdout
    bad = write_hosts(
        tmp_path / "b.toml", "box", host="x", train={**HYBRID, "producer_gpus": [0], "trainer_gpus": [0]}
    )
    res = dry_run(bad)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "share GPU 0: list disjoint GPUs" in res.stderr
