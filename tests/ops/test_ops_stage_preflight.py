"""The stage's own preflight inside the image, before anything is stopped: real sshd, real dockerd, the real
`pipeline preflight -- STAGE ARGV` (which checks the argv as `pipeline check-args` does) in the stage
container on a tiny real model. A misconfigured run ends with exit 4 naming the failed check, and the
server container was never stopped; the preflight container starts one python process."""

from __future__ import annotations

import io
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ops_docker import TEST_LABEL, client, remove_test_containers, server_on_one_gpu, stage_image
from ops_helpers import REPO, run_ops, ssh_table, write_hosts

pytestmark = [pytest.mark.sshd, pytest.mark.docker, pytest.mark.slow]

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}
STANDIN_VLLM = "0.31.0"  # a vLLM version the pipeline has no patch set for


@pytest.fixture(scope="module")
def dk():
    return client()


def standin_vllm_image(dk, base: str) -> str:
    """The stage image plus an installed-looking vLLM STANDIN_VLLM (a package and its dist-info on
    PYTHONPATH, no code): what an image built with an unpatched vLLM looks like to the preflight."""
    site = "/opt/standin-vllm"
    dockerfile = (
        f"FROM {base}\n"
        f"RUN mkdir -p {site}/vllm {site}/vllm-{STANDIN_VLLM}.dist-info"
        f" && echo '__version__ = \"{STANDIN_VLLM}\"' > {site}/vllm/__init__.py"
        f" && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: {STANDIN_VLLM}\\n'"
        f" > {site}/vllm-{STANDIN_VLLM}.dist-info/METADATA\n"
        f"ENV PYTHONPATH={REPO}:{site}\n"
    )
    tag = f"{base.split(':')[0]}-vllm{STANDIN_VLLM}:{base.split(':')[1]}"
    dk.images.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=tag, pull=False, rm=True, labels={TEST_LABEL: "1"}
    )
    return tag


@pytest.fixture(scope="module")
def scene(tmp_path_factory, dk, sshd, warm_pipeline):
    """A 'GPU host' whose server container holds the one GPU, a tiny real model, prepared samples with
    vocab files, and a hosts file per misconfiguration (`hosts(name, **keys)`)."""
    tmp = tmp_path_factory.mktemp("pfscene")
    env = {"PYTHONDONTWRITEBYTECODE": "1"}  # demo-assets and prepare warm (tests/warm_cli.py)
    warm_pipeline("demo-assets", "--out", tmp / "assets", "--conversations", 4, check=True, env=env)
    model = tmp / "assets" / "model"
    good = tmp / "good"
    (good / "cache").mkdir(parents=True)
    warm_pipeline(
        "prepare",
        "--data",
        tmp / "assets" / "conversations.jsonl",
        "--model",
        model,
        "--out",
        good / "prepared",
        "--draft-vocab-size",
        32,
        check=True,
        env=env,
    )
    img, mounts = stage_image(dk, REPO, sys.base_prefix)
    server, devdir, table = server_on_one_gpu(dk, tmp, "ops-test-pf-server")
    name = server.name
    known = sshd.write_known_hosts(tmp / "known_hosts")
    base = ssh_table(
        sshd,
        known,
        server=f"container:{name}",
        device_glob=f"{devdir}/nvidia*",
        gpu_source=f"table:{table}",
        timeouts=FAST,
        image=img,
        docker_gpus="",
        mounts=mounts,
        data_root=str(good),
        model_dir=str(model),
        cache_dir=str(good / "cache"),
    )

    def hosts(label: str, **keys) -> Path:
        return write_hosts(tmp / f"{label}.toml", "pfbox", **{**base, **keys})

    yield dict(tmp=tmp, good=good, model=model, server=server, hosts=hosts, image=img, table=table)
    remove_test_containers(dk, [name])


def counting_image(dk, base: str) -> str:
    """The stage image with a `python` first on PATH that appends its arguments (their first line) to
    /data/python-calls.log, then runs the venv's python: every python process a container of it starts by
    name is on record."""
    # a printf format (its \n are newlines); single-quoted, so "$*" and "$@" reach the script as written
    shim, where = (
        rf'#!/bin/sh\necho "$*" | head -n 1 >> /data/python-calls.log\nexec {sys.prefix}/bin/python "$@"\n',
        "/opt/counted",
    )
    dockerfile = (
        f"FROM {base}\n"
        f"RUN mkdir -p {where} && printf '{shim}' > {where}/python && chmod 755 {where}/python\n"
        f"ENV PATH={where}:{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin\n"
    )
    tag = f"{base.split(':')[0]}-counted:{base.split(':')[1]}"
    dk.images.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=tag, pull=False, rm=True, labels={TEST_LABEL: "1"}
    )
    return tag


def data_root(scene, label: str, *, prepared: bool = True) -> Path:
    """A fresh data root (cache, and a copy of the good prepared samples)."""
    root = scene["tmp"] / f"data-{label}"
    (root / "cache").mkdir(parents=True)
    if prepared:
        shutil.copytree(scene["good"] / "prepared", root / "prepared")
    return root


def refused(scene, hosts: Path, *args: str, stage: tuple[str, ...] = ("remote-extract",)):
    """Run the command; it must end with exit 4 and one error line; the server container must still run,
    started at the same time as before (never stopped and restarted), and no stage container exists."""
    server = scene["server"]
    server.reload()
    started = server.attrs["State"]["StartedAt"]
    t0 = time.monotonic()
    res = run_ops(
        *stage,
        "--host",
        "pfbox",
        "--hosts-file",
        str(hosts),
        "--runs-dir",
        str(scene["tmp"] / "runs"),
        *args,
        timeout=300,
    )
    seconds = time.monotonic() - t0
    assert res.returncode == 4, res.stdout[-3000:] + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("error: preflight failed: "), (
        res.stderr
    )
    server.reload()
    assert server.status == "running" and server.attrs["State"]["StartedAt"] == started
    assert not client().containers.list(all=True, filters={"label": "eagle-ops.host=pfbox"})
    return res, seconds


def test_wrong_layer_ids_are_refused_before_the_server_stops(scene):
    """Layer ids the model does not have: the image's preflight names `layer ids`, exit 4, server untouched;
    the checks ran with the stage's own arguments and the layout the host resolved (hf: no vLLM in the
    image)."""
    hosts = scene["hosts"]("layers", data_root=str(data_root(scene, "layers")))
    res, seconds = refused(scene, hosts, "--run-id", "pf-layers", "--", "--layer-ids", "0,1,2")
    assert "error: preflight failed: layer ids: " in res.stderr
    run = json.loads((scene["tmp"] / "runs" / "pfbox" / "pf-layers" / "run.json").read_text())
    assert run["layout"] == {
        "backend": "hf",
        "tensor_parallel_size": 1,
        "data_parallel": 1,
        "reason": "vLLM is not installed",
    }
    assert "--layer-ids 0,1,2" in run["preflight_run"][-1] and "--backend hf" in run["preflight_run"][-1]
    assert "image python" in res.stdout and "no vLLM in the image" in res.stdout
    print(f"layer ids refused in {seconds:.1f} s")


def test_the_image_preflight_is_one_python_process(scene, dk):
    """The preflight container starts one python process, `pipeline preflight ... -- extract ARGV`, which
    refuses wrong layer ids (exit 4, server untouched) without loading the tokenizer (the checks that import
    transformers and torch are skipped and said so). The other python process in the image is the layout's
    look for vLLM (backend auto), a container of its own that imports neither."""
    root = data_root(scene, "count")
    hosts = scene["hosts"]("count", data_root=str(root), image=counting_image(dk, scene["image"]))
    res, seconds = refused(scene, hosts, "--run-id", "pf-count", "--", "--layer-ids", "0,1,2")
    assert "error: preflight failed: layer ids: " in res.stderr
    calls = (root / "python-calls.log").read_text().splitlines()
    assert len(calls) == 2 and calls[0].startswith("-c import importlib.metadata"), calls
    assert calls[1].startswith("-m pipeline preflight --model /model --prepared /data/prepared "), calls
    assert " --fail-fast-on any -- extract --prepared /data/prepared " in calls[1]
    log = (scene["tmp"] / "runs" / "pfbox" / "pf-count" / "preflight.log").read_text()
    assert "warn skipped: tokenizer, chat template: not checked, `layer ids` failed" in log
    print(f"layer ids refused in {seconds:.1f} s, python processes in the image: {calls}")


def test_misspelt_stage_argument_is_refused(scene):
    """An option the stage does not know (`--layer-id`) is refused by the preflight's `arguments` check
    (`pipeline check-args`' own), exit 4."""
    hosts = scene["hosts"]("args", data_root=str(data_root(scene, "args")))
    res, _ = refused(scene, hosts, "--run-id", "pf-args", "--", "--layer-id", "0,1,2,3")
    assert "error: preflight failed: arguments: pipeline extract: No such option '--layer-id'" in res.stderr


def test_missing_tokenizer_is_refused_for_extract_and_prepare(scene):
    """A model folder without its tokenizer: extract and prepare are both refused naming `tokenizer`."""
    model = scene["tmp"] / "model-notok"
    shutil.copytree(scene["model"], model)
    gone = [
        p for p in model.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges"))
    ]
    assert gone
    for p in gone:
        p.unlink()
    hosts = scene["hosts"]("notok", data_root=str(data_root(scene, "notok")), model_dir=str(model))
    res, _ = refused(scene, hosts, "--run-id", "pf-notok")
    assert "error: preflight failed: tokenizer: " in res.stderr
    conv = data_root(scene, "notok-prep", prepared=False)
    shutil.copy(scene["tmp"] / "assets" / "conversations.jsonl", conv / "conversations.jsonl")
    hosts = scene["hosts"]("notok-prep", data_root=str(conv), model_dir=str(model))
    res, _ = refused(scene, hosts, "--run-id", "pf-notok-prep", stage=("remote-run", "prepare"))
    assert "error: preflight failed: tokenizer: " in res.stderr


def test_vocab_file_of_another_model_is_refused(scene):
    """t2d.npy made for a bigger vocabulary (another model's): `vocab files` fails, exit 4."""
    root = data_root(scene, "vocab")
    t2d = np.load(root / "prepared" / "t2d.npy")
    other = np.zeros(len(t2d) * 2, dtype=bool)
    other[: int(t2d.sum())] = True
    np.save(root / "prepared" / "t2d.npy", other)
    hosts = scene["hosts"]("vocab", data_root=str(root))
    res, _ = refused(scene, hosts, "--run-id", "pf-vocab")
    assert "error: preflight failed: vocab files: " in res.stderr


def test_vllm_without_a_patch_set_is_refused(scene, dk):
    """An image with a vLLM the pipeline has no patch set for: backend auto picks vllm (tensor parallel over
    the host's one GPU), and the image's preflight refuses naming the vLLM version, exit 4."""
    image = standin_vllm_image(dk, scene["image"])
    hosts = scene["hosts"]("standin", data_root=str(data_root(scene, "standin")), image=image)
    res, _ = refused(scene, hosts, "--run-id", "pf-vllm")
    line = res.stderr.lower()
    check = line.removeprefix("error: preflight failed: ").split(":", 1)[0]  # the failed check's name
    assert "vllm" in check and STANDIN_VLLM in line, res.stderr
    run = json.loads((scene["tmp"] / "runs" / "pfbox" / "pf-vllm" / "run.json").read_text())
    # the stand-in host reports no GPU memory: auto's rule (contract/backends.py) then shards with vLLM
    assert run["layout"] == {
        "backend": "vllm",
        "tensor_parallel_size": 1,
        "data_parallel": 1,
        "reason": "the model's size or the GPU memory is unknown: vLLM shards it over the GPUs",
    }
    assert f"vLLM {STANDIN_VLLM}" in res.stdout


def test_host_driver_older_than_the_image_needs_is_refused(scene, dk):
    """An image labelled eagle-ops.min-driver=580 (vLLM 0.32's CUDA 13.0 build) on a host whose NVIDIA
    driver is 570: the host preflight names `driver` and both versions, exit 4, server untouched."""
    from ops.preflight import MIN_DRIVER_LABEL

    tag = f"{scene['image'].split(':')[0]}-driver580:{scene['image'].split(':')[1]}"
    dk.images.build(
        fileobj=io.BytesIO(f"FROM {scene['image']}\n".encode()),
        tag=tag,
        pull=False,
        rm=True,
        labels={TEST_LABEL: "1", MIN_DRIVER_LABEL: "580"},
    )
    table = json.loads(Path(scene["table"]).read_text())
    old = scene["tmp"] / "gpus-driver570.json"
    old.write_text(json.dumps({**table, "driver": "570.86.15"}))
    hosts = scene["hosts"](
        "driver", data_root=str(data_root(scene, "driver")), image=tag, gpu_source=f"table:{old}"
    )
    res, _ = refused(scene, hosts, "--run-id", "pf-driver")
    assert (
        "error: preflight failed: driver: NVIDIA driver 570.86.15 on pfbox is older than the image needs "
        "(>= 580" in res.stderr
    )
