"""The launcher of a data-parallel stage: ``python -m pipeline.runtime.torchrun [torchrun's options] -m
pipeline train ...`` is torchrun (torch.distributed.run: its arguments, its rendezvous, one process per rank)
with our report of a failed job. torchrun's own report is a many-line ``ChildFailedError`` traceback after
the ranks' own one-line errors; here the ranks' lines stay the job's report and the launcher exits with the
first failed rank's exit code (2 for a refused input, as one process would), adding one line only when no
rank said why (a rank killed by a signal)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        print(
            f"error: data-parallel rank {rank} ended by signal {-failure.exitcode} (the kernel's OOM killer, "
            "a kill from outside): the job stopped; resume with --resume",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
