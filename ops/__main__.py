from ops.cli import run

run()
