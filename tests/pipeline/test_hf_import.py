"""pipeline/backends/hf.py's transformers import in a thread of its own (the hf backend starts it before
CUDA's start on a GPU, so that the two overlap): it imports what the load needs, and an import that fails
there fails again, reported, where the load imports it. Real interpreters, fresh each."""

from __future__ import annotations

import subprocess
import textwrap

from tests.conftest import PYTHON, REPO

SCRIPT = textwrap.dedent(
    """
    import sys, threading
    from pipeline.backends.hf import import_transformers_in_background

    thread = import_transformers_in_background()
    assert thread.name == "transformers-import" and thread is not threading.main_thread()
    thread.join(120)
    assert not thread.is_alive()
    loaded = "transformers.models.auto.modeling_auto" in sys.modules
    try:
        from transformers import AutoModelForCausalLM
        print("import ok", loaded)
    except ImportError as exc:
        print("import failed:", exc)
    """
)


def run(tmp_path, pythonpath: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-c", SCRIPT],
        cwd=REPO,
        env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_the_thread_imports_the_auto_classes(tmp_path):
    done = run(tmp_path, str(REPO))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "import ok True", done.stdout


def test_a_failing_import_is_reported_where_the_load_imports(tmp_path):
    broken = tmp_path / "transformers"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('this transformers is broken')\n")
    done = run(tmp_path, f"{tmp_path}:{REPO}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "import failed: this transformers is broken", done.stdout
    assert "Traceback" not in done.stderr, done.stderr  # the thread said nothing of its own
