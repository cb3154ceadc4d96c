"""This process and the write: whether it is the writer under torchrun, and SIGTERM turned into Ctrl-C.

SIGTERM during the write phase is turned into an interruption (:class:`Terminated`, a
``KeyboardInterrupt``) so the temporary folder is removed, as Ctrl-C does; the CLI does so for
the whole run (:func:`sigterm_as_interrupt`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so the same clean-up runs (the CLI exits 143)."""


def torchrun_rank() -> int | None:
    """This process's rank under torchrun (WORLD_SIZE > 1), else None."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
            return None
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return None  # malformed: graphcal.calibration.distributed.from_env reports it


@contextlib.contextmanager
def sigterm_as_interrupt(enabled: bool = True, only_if_default: bool = False) -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated` in the main thread; the previous handler is put
    back on the way out. Does nothing outside the main thread, when not ``enabled``, or, with
    ``only_if_default``, when SIGTERM already has a handler other than the default one."""
    if (not enabled or threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "SIGTERM")):
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or (only_if_default and previous is not signal.SIG_DFL):
        yield  # None: a handler set outside Python, which could not be put back
        return

    def interrupt(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
