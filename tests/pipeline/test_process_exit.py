"""pipeline/runtime/process_exit.py: a `python -m pipeline` process ends as Python's exit does what a program
can observe (threads joined, atexit handlers run, output flushed, SystemExit's status) without the teardown of
its modules. Real interpreters, real exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pipeline.runtime.process_exit import run_then_exit

    class Teardown:
        def __del__(self):
            print("teardown ran", flush=True)

    keep = Teardown()  # a module global: only the interpreter's teardown deletes it
    pools = []

    def late():
        time.sleep(0.3)
        open(sys.argv[1], "w").write("thread finished")

    def main():
        threading.Thread(target=late).start()  # not a daemon: the exit must wait for it
        pools.append(ThreadPoolExecutor(2))  # kept and never shut down: its idle workers are not daemons
        pools[0].submit(time.sleep, 0.1)
        atexit.register(lambda: print("atexit ran"))
        sys.stdout.write("buffered, no newline;")  # still in the buffer: stdout is a pipe
        EXIT

    if sys.argv[2] == "fast":
        run_then_exit(main)
    else:
        main()
    """
)


def run_script(tmp_path, exit_line: str, mode: str) -> subprocess.CompletedProcess:
    script = SCRIPT.replace("EXIT", exit_line)
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "thread"), mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "exit_line, code, stderr",
    [("pass", 0, ""), ("raise SystemExit(3)", 3, ""), ("raise SystemExit('bad input')", 1, "bad input\n")],
)
def test_the_fast_exit_keeps_what_a_program_observes_and_skips_teardown(tmp_path, exit_line, code, stderr):
    fast = run_script(tmp_path, exit_line, "fast")
    assert fast.returncode == code, fast.stderr
    assert fast.stderr == stderr
    assert fast.stdout.startswith("buffered, no newline;") and "atexit ran" in fast.stdout, fast.stdout
    assert (tmp_path / "thread").read_text() == "thread finished"
    assert "teardown ran" not in fast.stdout

    # the control: Python's own exit gives the same status and output, and does tear the module down
    (tmp_path / "thread").unlink()
    slow = run_script(tmp_path, exit_line, "python")
    assert (slow.returncode, slow.stderr) == (code, stderr)
    assert slow.stdout == fast.stdout + "teardown ran\n"
    assert (tmp_path / "thread").read_text() == "thread finished"


def test_other_exceptions_are_left_to_python(tmp_path):
    result = run_script(tmp_path, "raise RuntimeError('boom')", "fast")
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith("RuntimeError: boom"), result.stderr
    assert "teardown ran" in result.stdout  # Python's ordinary exit, teardown included


def test_python_m_pipeline_ends_through_the_fast_exit():
    """`python -m pipeline`'s __main__ hands its status to process_exit.finish (a refusal: status 2)."""
    probe = (
        "import runpy, sys, pipeline.runtime.process_exit as p\n"
        "real = p.finish\n"
        "p.finish = lambda code: (print(f'finish({code})', file=sys.stderr), real(code))\n"
        "sys.argv = ['pipeline', 'check-args', 'prepare', '--seq-length', '1']\n"
        "runpy.run_module('pipeline', run_name='__main__', alter_sys=True)\n"
        "print('not reached', file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout.startswith("FAIL arguments: pipeline prepare: Missing option"), result.stdout
    assert result.stderr == "finish(2)\n"  # and nothing after it: the process ended there


def test_ctrl_c_while_the_exit_waits_for_a_thread_ends_with_130(tmp_path):
    """A command that returned 0 but left a thread running: Ctrl-C during the wait is no clean exit."""
    script = textwrap.dedent(
        """
        import sys, threading, time
        from pipeline.runtime.process_exit import run_then_exit

        def main():
            threading.Thread(target=time.sleep, args=(60,)).start()
            print("returned", flush=True)

        run_then_exit(main)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "returned\n"
        time.sleep(0.5)  # into the join
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        proc.kill()
        proc.wait()
