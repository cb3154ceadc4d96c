"""How every verb runs its work: graphcal's errors become one line and an exit code, SIGTERM acts as Ctrl-C,
and either stops the command within about a second even inside a long call in C; the command's module-name
patterns share one matching budget (graph.names)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

import click

from graphcal.calibration.distributed import settle
from graphcal.errors import GraphcalError, first_line
from graphcal.graph.names import one_budget
from graphcal.output import Terminated, sigterm_as_interrupt, torchrun_rank
from graphcal.output.process import run_abort_cleanups

GRACE_S = 1.0  # how long the main thread has to take SIGINT / SIGTERM before the watcher stops the process
INTERRUPTED = "interrupted; no output was written"
EXIT_CODES = {signal.SIGINT: 130, getattr(signal, "SIGTERM", signal.SIGINT): 143}


def guarded(call, debug: bool):
    """Run ``call``; turn graphcal's errors into one line and an exit code.

    SIGTERM is handled like Ctrl-C (temporary files removed), exiting 143 instead of 130. Not under
    torchrun, whose SIGTERM must stop a rank at once even while it waits in a collective; there the
    output's write phase alone does so (graphcal.output). Either signal stops the command within
    about :data:`GRACE_S` even while the main thread is inside one long call in C (:func:`stops_promptly`).
    Every module-name pattern the command matches draws on one budget (graph.names' :func:`one_budget`).
    """
    alone = torchrun_rank() is None
    try:
        with sigterm_as_interrupt(enabled=alone), stops_promptly(enabled=alone), one_budget():
            return call()
    except GraphcalError as e:
        if debug:
            raise
        click.echo(f"error: {e}", err=True)
        settle(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        click.echo(INTERRUPTED, err=True)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    except Exception as e:  # a bug or an input graphcal did not foresee: still one line, no half output
        if debug:
            raise
        detail = first_line(e) if str(e).strip() else ""  # the type is named just before
        click.echo(f"error: unexpected {type(e).__name__}: {detail} (rerun with --debug for the traceback)", err=True)
        settle(e)
        sys.exit(1)


class _Stop:
    """Who handles a SIGINT / SIGTERM: the main thread (its handler ran: the usual clean-up follows)
    or the watcher (the main thread did not take it in time: the watcher cleans up and exits)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: str | None = None
        self.taken = threading.Event()  # the main thread's handler ran

    def claim(self, who: str) -> bool:
        with self.lock:
            if self.owner is None:
                self.owner = who
            return self.owner == who


@contextlib.contextmanager
def stops_promptly(enabled: bool = True) -> Iterator[None]:
    """Inside, SIGINT and SIGTERM stop the process within about :data:`GRACE_S` seconds.

    Python runs a signal's handler in the main thread between bytecodes, so a main thread inside one
    long call in C (an onnxruntime run over a big batch: eval kept running 15 s after SIGTERM) sees
    the signal only when the call returns. The signal also wakes a watching thread (``signal.set_wakeup_fd``,
    written by the C-level handler at once); when the main thread's handler has not run within
    :data:`GRACE_S`, the watcher runs the clean-ups registered with
    :func:`graphcal.output.process.on_abort` (temporary files, ``-o``'s lock), prints the usual line and
    exits (130 for SIGINT, 143 for SIGTERM). Does nothing outside the main thread or when not ``enabled``.
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except (ValueError, OSError):  # not settable here (an embedding interpreter): the handlers alone
        os.close(read)
        os.close(write)
        yield
        return
    stop = _Stop()
    previous = {sig: _mark(sig, stop) for sig in EXIT_CODES}
    threading.Thread(target=_watch, args=(read, stop), name="graphcal-signals", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        os.close(write)  # the watcher reads end of file and closes its end


def _mark(sig: int, stop: _Stop):
    """Wrap ``sig``'s Python handler so that running it tells the watcher the main thread has the
    signal; returns the handler replaced (None when it is not a Python function: left alone)."""
    handler = signal.getsignal(sig)
    if not callable(handler):
        return None

    def marked(signum, frame):
        if not stop.claim("main"):
            threading.Event().wait()  # the watcher is stopping the process: wait for its exit
        stop.taken.set()
        handler(signum, frame)

    signal.signal(sig, marked)
    return handler


def _watch(read: int, stop: _Stop) -> None:
    try:
        while data := os.read(read, 64):
            got = [b for b in data if b in EXIT_CODES]
            if not got or stop.taken.wait(GRACE_S):
                continue  # another signal, or the main thread took it: its clean-up runs as usual
            if stop.claim("watcher"):
                run_abort_cleanups()
                with contextlib.suppress(OSError):
                    os.write(2, f"{INTERRUPTED}\n".encode())
                os._exit(EXIT_CODES[got[0]])
    except OSError:
        pass
    finally:
        os.close(read)
