"""Helpers shared by the ops tests: hosts files, running the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_hosts(path: Path, name: str, **table) -> Path:
    """Write a hosts file with one [hosts.NAME] table (values in TOML)."""
    lines = [f"[hosts.{name}]"]
    sub = {}
    for key, value in table.items():
        if isinstance(value, dict):
            sub[key] = value
            continue
        lines.append(f"{key} = {toml_value(value)}")
    for key, value in sub.items():
        lines.append(f"[hosts.{name}.{key}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in value.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(value) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def ssh_table(sshd: Sshd, known_hosts: Path, **extra) -> dict:
    return dict(host="127.0.0.1", port=sshd.port, user=sshd.user, key=str(sshd.user_key),
                known_hosts=str(known_hosts), python="/usr/bin/python3", **extra)


def run_ops(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m ops ARGS` as the operator would, from the repo root."""
    full_env = dict(os.environ, COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-m", "ops", *args], cwd=REPO, capture_output=True, text=True,
                          env=full_env, timeout=timeout)
