"""Errors a stage raises for bad input or a failed check.

Owns the exception types and their exit codes (only the CLI turns them into process exits), and the
one-line refusal of a number outside its allowed range.
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


def require_range(
    flag: str, value: float | None, low: float, high: float | None = None, *, low_open: bool = False
) -> None:
    """Refuse a number outside ``low..high`` (``low`` itself too when ``low_open``), and NaN or an infinity,
    in one line naming the allowed range."""
    import math

    if value is None:
        return
    finite = not isinstance(value, float) or math.isfinite(value)
    below = value <= low if low_open else value < low
    if not finite or below or (high is not None and value > high):
        if low_open:
            allowed = f"greater than {low}" + (f", at most {high}" if high is not None else "")
        else:
            allowed = f"{low}..{high}" if high is not None else f"at least {low}"
        raise StageError(f"{flag} {value} is outside the allowed range ({allowed})")
