"""Errors a user can cause. The CLI prints them as one line and exits non-zero, without a traceback."""


class GraphcalError(Exception):
    """A problem with the user's input or environment; the message says what and what to do."""

    exit_code = 1


class UsageError(GraphcalError):
    """A wrong option or argument (exit code 2, like click's own usage errors)."""

    exit_code = 2
