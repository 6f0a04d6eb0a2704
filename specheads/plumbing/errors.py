"""The one error type that means "the user asked for something we cannot do"."""


class UsageError(Exception):
    """Bad input: the message is one line that names the problem and the fix.

    The command line prints it without a traceback and exits non-zero.
    """


def refuse_above(option: str, values: int | list[int] | None, bound: int, what: str) -> None:
    """Refuse a count (the largest of `values` when a list) above `bound`: one line naming `option`, what it counts and
    the fix."""
    largest = max(values, default=0) if isinstance(values, list) else values or 0
    if largest > bound:
        raise UsageError(f"{option} {largest} is above {bound:,}: {what}; give at most {bound:,}")
