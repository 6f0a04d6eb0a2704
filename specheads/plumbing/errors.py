"""The one error type that means "the user asked for something we cannot do"."""


class UsageError(Exception):
    """Bad input: the message is one line that names the problem and the fix.

    The command line prints it without a traceback and exits non-zero.
    """
