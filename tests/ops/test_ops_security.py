"""Secrets and privileges of the stage container, end to end: real sshd, real dockerd, real `ps`, a real
stage container started by remote-run as a non-root user, canary secrets from the operator's environment."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ops_docker import TEST_LABEL, client, stage_image
from ops_helpers import REPO, run_ops, ssh_table, write_hosts
from ops_procs import write_gpu_table

pytestmark = [pytest.mark.sshd, pytest.mark.docker, pytest.mark.slow]

UID = 4242  # the data root's owner: a uid the image's passwd does not know
CANARY = {"HF_TOKEN": "hf_CANARY_7f3a9c1e5b2d4f6a8c0e", "FOO_API_KEY": "fooKEY-CANARY-2b4d6f8a0c1e3a5c"}
FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}

# Stands in for `python -m pipeline` (bind-mounted over the checkout's pipeline/): reports what the stage
# sees from inside (hashes of the secrets, its capabilities, which paths it can write), prints one secret
# value outright (ops must redact it), then waits for /data/go so that the test can look at the host
# while the container runs.
FAKE_STAGE = r"""
import hashlib, json, os, sys, time
if sys.argv[1:2] == ["check-args"]:  # the preflight in the image: this stand-in accepts any arguments
    print("ok   arguments: stand-in pipeline")
    sys.exit(0)
out = sys.argv[-1]
def writable(path):
    try:
        with open(os.path.join(path, ".probe"), "w") as fh:
            fh.write("x")
        os.remove(os.path.join(path, ".probe"))
        return True
    except OSError:
        return False
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
seen = {n: hashlib.sha256(os.environ.get(n, "").encode()).hexdigest() for n in ("HF_TOKEN", "FOO_API_KEY")}
facts = {"uid": os.getuid(), "gid": os.getgid(), "cap_eff": status["CapEff"].strip(),
         "no_new_privs": status["NoNewPrivs"].strip(), "root_fs_writable": writable("/etc"),
         "tmp_writable": writable("/tmp"), "data_writable": writable("/data"), "secrets": seen}
print("stage facts " + json.dumps(facts), flush=True)
print("leaky stage prints " + os.environ.get("HF_TOKEN", ""), flush=True)
deadline = time.time() + 120
while not os.path.exists("/data/go") and time.time() < deadline:
    time.sleep(0.1)
with open(os.path.join(out, "summary.json"), "w") as fh:
    json.dump({"checks": [{"name": "fake", "status": "ok", "detail": "done"}], "facts": facts}, fh)
"""


@pytest.fixture(scope="module")
def dk():
    return client()


@pytest.fixture(scope="module")
def image(dk):
    """The test stage image, with /root traversable: the venv's interpreter is mounted under /root, and
    the stage runs as a non-root uid."""
    tag, mounts = stage_image(dk, REPO, sys.base_prefix)
    dockerfile = f"FROM {tag}\nRUN chmod 0755 /root\n"
    nonroot = f"{tag.split(':')[0]}-nonroot:{tag.split(':')[1]}"
    dk.images.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=nonroot, pull=False, rm=True, labels={TEST_LABEL: "1"}
    )
    return nonroot, mounts


def _owned_tree(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        os.chown(path, UID, UID)


def _host(sshd, tmp: Path, data: Path, model: Path, image, **extra) -> Path:
    (tmp / "dev").mkdir()
    table = write_gpu_table(tmp / "gpus.json", [{"processes": []}])
    img, mounts = image
    kw = ssh_table(
        sshd,
        sshd.write_known_hosts(tmp / "known_hosts"),
        device_glob=f"{tmp}/dev/nvidia*",
        gpu_source=f"table:{table}",
        timeouts=FAST,
        image=img,
        docker_gpus="",
        data_root=str(data),
        model_dir=str(model),
        cache_dir=str(data / "cache"),
    )
    kw["mounts"] = [*mounts, *extra.pop("mounts", [])]
    kw.update(extra)
    return write_hosts(tmp / "hosts.toml", "box", **kw)


class EnvDirWatch:
    """Polls the secrets folder while the run starts: every mode the env directory and file had, and a
    `ps` snapshot taken while the file existed."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.modes, self.ps, self.stop = folder, set(), None, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            for entry in os.scandir(self.folder):
                try:
                    self.modes.add(("dir", os.lstat(entry.path).st_mode & 0o7777))
                    env = os.lstat(os.path.join(entry.path, "env"))
                except OSError:
                    continue
                self.modes.add(("file", env.st_mode & 0o7777))
                if self.ps is None:
                    self.ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
            time.sleep(0.001)

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)


def _docker_inspect(name: str) -> dict:
    out = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def test_secrets_reach_the_container_and_nothing_else(tmp_path, dk, image, sshd):
    """Canary secrets in HF_TOKEN and FOO_API_KEY reach the stage container (it reports their hashes) but
    appear in no process listing (during `docker run` and while the stage runs), not in the container's
    command, not in the printed output, the trace file or any file under runs/, even though the stage
    prints one; the env file existed only as 0600 in a 0700 directory and is gone once the stage runs.
    The container runs with the least privilege (docker inspect, and the stage's own view from inside)."""
    data = tmp_path / "data"
    (data / "hidden_states").mkdir(parents=True)
    (data / "cache").mkdir()
    _owned_tree(data)
    fake = tmp_path / "fake_pipeline"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_STAGE)
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    hosts = _host(
        sshd,
        tmp_path,
        data,
        tmp_path,
        image,
        secrets=["HF_TOKEN", "FOO_API_KEY", "UNSET_TOKEN"],
        secrets_dir=str(secrets_dir),
        mounts=[f"{fake}:{REPO}/pipeline:ro"],
    )
    runs, trace = tmp_path / "runs", tmp_path / "trace.jsonl"
    env = dict(os.environ, COLUMNS="200", EAGLE_OPS_TRACE=str(trace), **CANARY)
    env.pop("UNSET_TOKEN", None)
    watch = EnvDirWatch(secrets_dir)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ops",
            "remote-run",
            "verify",
            "--run-id",
            "sec1",
            "--host",
            "box",
            "--hosts-file",
            str(hosts),
            "--runs-dir",
            str(runs),
        ],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("stage facts "):
                break
        watch.close()
        assert lines and lines[-1].startswith("stage facts "), "".join(lines)
        facts = json.loads(lines[-1].split(" ", 2)[2])
        # the stage runs: look at the host now
        listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        ctr = _docker_inspect("eagle-sec1")
        left_in_secrets_dir = list(secrets_dir.iterdir())
        (data / "go").write_text("")
        rest, _ = proc.communicate(timeout=120)
    finally:
        watch.close()
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["docker", "rm", "--force", "eagle-sec1"], capture_output=True)
    printed = "".join(lines) + rest
    assert proc.returncode == 0, printed
    assert facts["secrets"] == {n: hashlib.sha256(v.encode()).hexdigest() for n, v in CANARY.items()}
    assert watch.ps is not None and ("file", 0o600) in watch.modes, watch.modes
    assert {m for kind, m in watch.modes if kind == "file"} == {0o600}
    assert {m for kind, m in watch.modes if kind == "dir"} == {0o700}
    assert left_in_secrets_dir == [] and list(secrets_dir.iterdir()) == []
    command = json.dumps([ctr["Path"], ctr["Args"], ctr["Config"]["Cmd"], ctr["Config"]["Entrypoint"]])
    files = {str(p): p.read_text(errors="replace") for p in runs.rglob("*") if p.is_file()}
    assert {Path(p).name for p in files} >= {"run.json", "stage.log", "summary.json", "container.json"}
    for value in CANARY.values():
        for where, text in [
            ("ps during docker run", watch.ps),
            ("ps while running", listing),
            ("container command", command),
            ("printed output", printed),
            ("trace", trace.read_text()),
            *files.items(),
        ]:
            assert value not in text, f"secret value found in {where}"
    assert "leaky stage prints [redacted]" in files[str(runs / "box" / "sec1" / "stage.log")]
    assert "not set on this machine: UNSET_TOKEN; passed: HF_TOKEN, FOO_API_KEY" in printed
    assert json.loads((runs / "box" / "sec1" / "run.json").read_text())["secrets"] == [
        "HF_TOKEN",
        "FOO_API_KEY",
    ]
    # least privilege, as docker reports it and as the stage saw it
    hc = ctr["HostConfig"]
    assert (
        hc["CapDrop"],
        hc["SecurityOpt"],
        hc["Privileged"],
        hc["ReadonlyRootfs"],
        hc["PidsLimit"],
        hc["IpcMode"],
        hc["ShmSize"],
    ) == (["ALL"], ["no-new-privileges"], False, True, 16384, "private", 16 << 30)
    assert ctr["Config"]["User"] == f"{UID}:{UID}" and "/tmp" in hc["Tmpfs"]
    assert facts["uid"] == UID and facts["gid"] == UID and int(facts["cap_eff"], 16) == 0
    assert facts["no_new_privs"] == "1" and not facts["root_fs_writable"]
    assert facts["tmp_writable"] and facts["data_writable"]


def test_dry_run_and_errors_show_names_never_values(tmp_path, dk, image, sshd):
    """`remote-run --dry-run` prints the exact docker run argv with --env-file and the secret names, no
    value; an error message that would contain a secret value shows it redacted."""
    data = tmp_path / "data"
    (data / "hidden_states").mkdir(parents=True)
    hosts = _host(sshd, tmp_path, data, tmp_path, image, secrets=["HF_TOKEN", "FOO_API_KEY"])
    res = run_ops(
        "remote-run",
        "verify",
        "--dry-run",
        "--run-id",
        "dry1",
        "--host",
        "box",
        "--hosts-file",
        str(hosts),
        env=CANARY,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (
        "secrets: HF_TOKEN, FOO_API_KEY (values through a 0600 env file in /dev/shm/eagle-ops-dry1-"
        in res.stdout
    )
    assert "--env-file /dev/shm/eagle-ops-dry1-" in res.stdout and "--cap-drop ALL" in res.stdout
    assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=dry1"})
    bad = run_ops(
        "gpu-status",
        "--host",
        "box",
        "--hosts-file",
        f"/nonexistent/{CANARY['FOO_API_KEY']}/h.toml",
        env=CANARY,
    )
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: hosts file /nonexistent/[redacted]/h.toml does not exist"
    )
    cut = run_ops(
        "remote-run",
        "verify",
        "--run-id",
        "nl1",
        "--host",
        "box",
        "--hosts-file",
        str(hosts),
        env={"HF_TOKEN": "first-line\nsecond-line-secret"},
    )
    assert cut.returncode == 2 and cut.stderr.strip() == (
        "error: secret HF_TOKEN contains a newline or NUL; an env file cannot carry it"
    ), cut.stderr
    assert cut.stdout == "" and not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=nl1"})
    for value in CANARY.values():
        assert value not in res.stdout + res.stderr + bad.stdout + bad.stderr


def test_real_stage_completes_as_the_data_owner_with_least_privilege(
    tmp_path, dk, image, sshd, warm_pipeline
):
    """The real `pipeline prepare` runs in the hardened container as the data root's (non-root) owner and
    completes; what it writes belongs to that owner; run.json records the hardened argv."""
    data = tmp_path / "data"
    assets = tmp_path / "assets"
    warm_pipeline(
        "demo-assets", "--out", assets, "--conversations", 4, check=True, env={"PYTHONDONTWRITEBYTECODE": "1"}
    )
    (data / "cache").mkdir(parents=True)
    shutil.copy(assets / "conversations.jsonl", data / "conversations.jsonl")
    _owned_tree(data)
    hosts = _host(sshd, tmp_path, data, assets / "model", image)
    res = run_ops(
        "remote-run",
        "prepare",
        "--run-id",
        "lp1",
        "--host",
        "box",
        "--hosts-file",
        str(hosts),
        "--runs-dir",
        str(tmp_path / "runs"),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    written = list((data / "prepared").rglob("*"))
    assert (data / "prepared" / "metadata.json").is_file() and written
    assert {(p.stat().st_uid, p.stat().st_gid) for p in [data / "prepared", *written]} == {(UID, UID)}
    argv = json.loads((tmp_path / "runs" / "box" / "lp1" / "run.json").read_text())["docker_run"]
    for flag in (
        ["--user", f"{UID}:{UID}"],
        ["--cap-drop", "ALL"],
        ["--security-opt", "no-new-privileges"],
        ["--read-only"],
        ["--ipc", "private"],
    ):
        i = argv.index(flag[0])
        assert argv[i : i + len(flag)] == flag
    assert "--privileged" not in argv


def test_stage_user_that_cannot_write_the_cache_fails_preflight(tmp_path, dk, image, sshd):
    """The data root belongs to uid 4242 but the cache folder to root (0755): preflight says the stage's
    user cannot write it, exit 4, before anything is stopped or started."""
    data = tmp_path / "data"
    (data / "hidden_states").mkdir(parents=True)
    _owned_tree(data)
    (tmp_path / "rootcache").mkdir(mode=0o755)
    hosts = _host(sshd, tmp_path, data, tmp_path, image, cache_dir=str(tmp_path / "rootcache"))
    res = run_ops(
        "remote-run",
        "verify",
        "--run-id",
        "cw1",
        "--host",
        "box",
        "--hosts-file",
        str(hosts),
        "--runs-dir",
        str(tmp_path / "runs"),
    )
    assert res.returncode == 4, res.stdout + res.stderr
    assert res.stderr.strip() == (
        f"error: preflight failed: user: the stage runs as {UID}:{UID} but cannot write "
        f"{tmp_path / 'rootcache'} (owner 0:0, mode 755); chown it or set stage_user in "
        "the hosts file"
    )
    assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=cw1"})
