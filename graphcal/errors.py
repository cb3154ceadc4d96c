"""Errors a user can cause. The CLI prints them as one line and exits non-zero, without a traceback."""


class GraphcalError(Exception):
    """A problem with the user's input or environment; the message says what and what to do."""

    exit_code = 1


class UsageError(GraphcalError):
    """A wrong option or argument (exit code 2, like click's own usage errors)."""

    exit_code = 2


def first_line(e: BaseException) -> str:
    """The first non-empty line of ``str(e)``, stripped; the exception type's name when there is none.

    How a foreign exception (onnx, onnxruntime, yaml, torch, compressed-tensors) is quoted inside
    graphcal's one-line messages.
    """
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__


def shown(text: str, width: int = 60) -> str:
    """A stranger's value quoted in a message, cut to ``width`` characters (it may be huge)."""
    return text if len(text) <= width else text[:width - 3] + "..."
