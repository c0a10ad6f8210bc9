"""Errors a stage raises for bad input or a failed check.

Owns the exception type and its exit code; only the CLI turns them into process exits.
"""

from __future__ import annotations


class StageError(Exception):
    """A problem the operator can fix: bad input, wrong flags, a failed check.

    The message is one line naming what is wrong and what to do.
    """

    exit_code = 2


class CheckFailed(StageError):
    """A verification check failed on a stage output."""

    exit_code = 3
