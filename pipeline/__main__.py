from pipeline.cli import run
from pipeline.runtime.process_exit import run_then_exit

if __name__ == "__main__":
    run_then_exit(
        run
    )  # ends the process without the interpreter's teardown (pipeline/runtime/process_exit.py)
