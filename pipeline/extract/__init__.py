"""The extract stage as a package: config.py (its options), plan.py (the batch plan, pure), writer.py (the
background writer), loop.py (the loop every backend shares, and its clock), resume.py (the output
directory's resume and repair policy), workers.py (data-parallel worker processes), stage.py (``run``: the
stage put together) and cli.py (``pipeline extract`` and ``extract-worker``). The checks its files are judged
by are pipeline/ondisk/integrity.py's, which the verify stage shares."""
