"""docs/quickstart.md's `bash rehearsal` blocks, run as written, in order, against the rehearsal host: the
session's real sshd, the real dockerd with the test stage image, a server container holding the host's one
stand-in GPU, the tiny Llama as the target and its conversations in the data root. A command the page shows
that no longer works (a renamed flag, a changed default, a step that fails) fails here, so the page cannot
rot. The page's hosts files are loaded by tests/test_docs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ops_docker import client, remove_test_containers, server_on_one_gpu, stage_image
from ops_helpers import REPO, loopback_hosts

pytestmark = [pytest.mark.sshd, pytest.mark.docker]

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}
PAGE = REPO / "docs" / "quickstart.md"


def rehearsal_blocks(text: str) -> list[str]:
    """The fenced blocks whose info string is `bash rehearsal`, in page order."""
    return re.findall(r"```bash rehearsal\n(.*?)```", text, re.S)


def test_the_page_has_rehearsal_blocks():
    """The blocks the test below runs are there, and they cover the path: ship, look, rehearse, run."""
    commands = " ".join(rehearsal_blocks(PAGE.read_text()))
    for needle in (
        "ship-image",
        "gpu-status",
        "--dry-run",
        "remote-run prepare",
        "remote-extract",
        "weights",
    ):
        assert needle in commands, needle


@pytest.fixture
def rehearsal_host(tmp_path, sshd, tiny_assets):
    """The host of the page's commands: hosts file `box` (the page's `$HOST`), its server a container
    holding the one GPU, data root with the conversations, the stage image on the same engine."""
    dk = client()
    image, mounts = stage_image(dk, REPO, sys.base_prefix)
    server, devdir, table = server_on_one_gpu(dk, tmp_path, "ops-test-quickstart")
    data = tmp_path / "data"
    (data / "cache").mkdir(parents=True)
    lines = (tiny_assets / "conversations.jsonl").read_text().splitlines()[:8]
    (data / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    hosts = loopback_hosts(
        tmp_path / "hosts.toml",
        "box",
        sshd,
        server.name,
        devdir,
        table,
        (image, mounts),
        data,
        tiny_assets / "model",
        FAST,
    )
    work = tmp_path / "laptop"
    work.mkdir()
    yield dict(hosts=hosts, data=data, server=server, work=work)
    for ctr in dk.containers.list(all=True, filters={"label": "eagle-ops.host=box"}):
        if ctr.labels.get("eagle-ops.output", "").startswith(f"{data}/"):
            ctr.remove(force=True)
    remove_test_containers(dk, [server.name])
    subprocess.run(["rm", "-rf", "--", str(data)], check=False)  # files the stage's user wrote


def test_the_quickstart_commands_run_on_the_rehearsal_host(rehearsal_host):
    """Every command of the page's rehearsal blocks exits 0, in order, from a laptop folder (runs/ lands
    there); then the data path's outputs exist, extract's summary was fetched and the server runs again."""
    host = rehearsal_host
    bindir = host["work"] / "bin"
    bindir.mkdir()
    # the page says `python`: the light environment's (a script, not a link: a link elsewhere loses the venv)
    (bindir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    env = dict(
        os.environ,
        HOST="box",
        EAGLE_OPS_HOSTS=str(host["hosts"]),
        DRAFT_VOCAB="256",
        PATH=f"{bindir}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        COLUMNS="200",
    )
    for block in rehearsal_blocks(PAGE.read_text()):
        for command in [line for line in block.splitlines() if line.strip()]:
            proc = subprocess.run(
                ["bash", "-c", command],
                cwd=host["work"],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
    data = host["data"]
    assert (data / "prepared" / "metadata.json").is_file()
    assert (data / "prepared" / "d2t.npy").is_file()
    assert (data / "hidden_states" / "checksums.json").is_file()
    assert (data / "verifier" / "verifier.safetensors").is_file()
    fetched = sorted(p.parent.name for p in (host["work"] / "runs" / "box").glob("*/summary.json"))
    assert [name.split("-")[0] for name in fetched].count("extract") == 1, fetched
    host["server"].reload()
    assert host["server"].status == "running"
