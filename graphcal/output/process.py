"""This process and the write: whether it is the writer under torchrun, and SIGTERM turned into Ctrl-C.

SIGTERM during the write phase is turned into an interruption (:class:`Terminated`, a
``KeyboardInterrupt``) so the temporary folder is removed, as Ctrl-C does; the CLI does so for
the whole run (:func:`sigterm_as_interrupt`).

Python runs a signal's handler in the main thread between two bytecodes, so a main thread inside
one long call in C (an onnxruntime run over a big batch, a tokenizer, an exporter) would only see
the signal when that call returns. The CLI therefore also stops the process from a watching thread
when the main thread has not taken the signal within a second (graphcal.cli.guard); before it
exits, it runs what :func:`on_abort` registered: the removal of temporary files and folders and
the release of ``-o``'s lock, so nothing half written stays behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Callable, Iterator

_ON_ABORT: dict[int, Callable[[], None]] = {}  # clean-ups for an abort from another thread, by registration order
_KEYS = itertools.count()


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


def register_abort(cleanup: Callable[[], None]) -> int:
    """Run ``cleanup`` if the process is stopped from another thread (:func:`run_abort_cleanups`)
    until :func:`unregister_abort` is called with the key returned."""
    key = next(_KEYS)
    _ON_ABORT[key] = cleanup
    return key


def unregister_abort(key: int | None) -> None:
    if key is not None:
        _ON_ABORT.pop(key, None)


@contextlib.contextmanager
def on_abort(cleanup: Callable[[], None]) -> Iterator[None]:
    """Inside, ``cleanup`` runs if the process is stopped from another thread (a temporary file's removal)."""
    key = register_abort(cleanup)
    try:
        yield
    finally:
        unregister_abort(key)


def run_abort_cleanups() -> None:
    """Run every registered clean-up, the latest first (a temporary folder before the lock beside it);
    each failure is ignored: the process is about to exit."""
    for key in sorted(_ON_ABORT, reverse=True):
        cleanup = _ON_ABORT.pop(key, None)
        if cleanup is not None:
            with contextlib.suppress(Exception):
                cleanup()
