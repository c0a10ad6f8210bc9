"""A second, private Docker engine for the multi-host tests: a second "GPU host" needs its own engine,
or each host's preflight would see the other's stage container as busy.

It is the same dockerd binary as the shared engine, started in its own network namespace (`unshare
--net`) with its own socket, data root, exec root (hence its own containerd) and containerd namespace,
no bridge and no iptables rules, so it touches nothing of the shared engine. The network namespace is not
optional: a dockerd started with --bridge=none in the host's namespace DELETES the host's docker0 (moby's
removeDefaultBridgeInterface), which breaks every container of the shared engine. It is stopped by its own
pid and its folder removed afterwards.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker

from ops_procs import terminate


@dataclass
class Engine:
    root: Path
    proc: subprocess.Popen

    @property
    def socket(self) -> str:
        return f"unix://{self.root}/docker.sock"

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.socket)

    def load(self, image: str) -> None:
        """Copy an image of the shared engine into this one (no registry here)."""
        save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
        subprocess.run(
            ["docker", "--host", self.socket, "load", "--quiet"],
            stdin=save.stdout,
            check=True,
            capture_output=True,
        )
        assert save.wait() == 0, f"docker save {image} failed"

    def stop(self) -> None:
        for ctr in self.client().containers.list(all=True):
            ctr.remove(force=True)
        terminate(self.proc, 30)
        shutil.rmtree(self.root, ignore_errors=True)


def start_engine() -> Engine:
    # a short path: containerd's sockets live under the exec root and unix socket paths are capped at 108
    root = Path(tempfile.mkdtemp(prefix="eng-", dir="/tmp"))
    ns = "".join(c for c in root.name if c.isalnum())  # containerd: letters and digits
    log = (root / "dockerd.log").open("w")
    proc = subprocess.Popen(
        [
            "unshare",
            "--net",
            "dockerd",
            "--host",
            f"unix://{root}/docker.sock",
            "--data-root",
            str(root / "data"),
            "--exec-root",
            str(root / "exec"),
            "--pidfile",
            str(root / "docker.pid"),
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
            "--ip-forward=false",
            "--containerd-namespace",
            ns,
            "--containerd-plugins-namespace",
            f"{ns}p",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    engine = Engine(root, proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"second dockerd exited: {(root / 'dockerd.log').read_text()[-2000:]}")
        try:
            engine.client().ping()
            return engine
        except Exception:
            time.sleep(0.5)
    engine.stop()
    raise RuntimeError("second dockerd did not answer within 60 s")
