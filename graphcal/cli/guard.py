"""How every verb runs its work: graphcal's errors become one line and an exit code, SIGTERM acts as Ctrl-C."""

from __future__ import annotations

import sys

import click

from graphcal.calibration.distributed import settle
from graphcal.errors import GraphcalError, first_line
from graphcal.output import Terminated, sigterm_as_interrupt, torchrun_rank


def guarded(call, debug: bool):
    """Run ``call``; turn graphcal's errors into one line and an exit code.

    SIGTERM is handled like Ctrl-C (temporary files removed), exiting 143 instead of 130. Not under
    torchrun, whose SIGTERM must stop a rank at once even while it waits in a collective; there the
    output's write phase alone does so (graphcal.output).
    """
    try:
        with sigterm_as_interrupt(enabled=torchrun_rank() is None):
            return call()
    except GraphcalError as e:
        if debug:
            raise
        click.echo(f"error: {e}", err=True)
        settle(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        click.echo("interrupted; no output was written", err=True)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    except Exception as e:  # a bug or an input graphcal did not foresee: still one line, no half output
        if debug:
            raise
        detail = first_line(e) if str(e).strip() else ""  # the type is named just before
        click.echo(f"error: unexpected {type(e).__name__}: {detail} (rerun with --debug for the traceback)", err=True)
        settle(e)
        sys.exit(1)

