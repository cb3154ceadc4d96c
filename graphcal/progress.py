"""Progress of a long stage: a bar on a terminal, and log lines (``-v``) everywhere.

Each stage (the smoothing and calibration passes, the weights, eval) reports how far it is, its
rate in the units that matter (samples/s for a pass, weights/s for the weight pass) and an
estimate of the time left, once at least two steps are done. On a terminal the bar shows it
(tqdm). Every ``every`` seconds, and at the end, a log line says it too: ``graphcal -v`` shows
those lines whether or not stderr is a terminal, so a job's log tells how far a run is.
"""

from __future__ import annotations

import logging
import math
import time

log = logging.getLogger("graphcal")

LOG_EVERY_S = 30.0


class Progress:
    """``with Progress("calibrating", total=512, unit="sample") as p: ... p.update(8)``.

    ``total`` None: unknown (a CalibrationDataReader), so no time left is estimated. ``bar``: show
    a tqdm bar (on a terminal only, as tqdm decides).
    """

    def __init__(self, stage: str, total: int | None, unit: str, *, bar: bool = True, every: float = LOG_EVERY_S,
                 clock=time.monotonic):
        from tqdm import tqdm  # lazy: only a progress bar needs it

        self.stage, self.total, self.unit, self.every, self.clock = stage, total, unit, every, clock
        self.done = 0
        self.start = self.last_log = clock()
        self.bar = tqdm(total=total, desc=stage, unit=unit, unit_scale=False, leave=False,
                        disable=None if bar else True)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)
        now = self.clock()
        if now - self.last_log >= self.every:
            self.last_log = now
            log.info("%s", self.line(now))

    def rate(self, now: float | None = None) -> float:
        elapsed = (self.clock() if now is None else now) - self.start
        return self.done / elapsed if elapsed > 0 else math.nan

    def left_s(self, now: float | None = None) -> float | None:
        """Seconds left at the rate so far (None: total unknown, or nothing done yet)."""
        rate = self.rate(now)
        if self.total is None or not self.done or not math.isfinite(rate) or rate <= 0:
            return None
        return max(self.total - self.done, 0) / rate

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        of = f"/{self.total:,}" if self.total is not None else ""
        rate = self.rate(now)
        units = self.unit + ("es" if self.unit.endswith("ch") else "s")
        text = f"{self.stage}: {self.done:,}{of} {units}"
        if math.isfinite(rate):
            text += f", {rate:,.1f} {units}/s"
        left = self.left_s(now)
        if left is not None and self.done < (self.total or 0):
            text += f", about {duration(left)} left"
        return text

    def close(self) -> None:
        self.bar.close()
        now = self.clock()
        log.info("%s in %s", self.line(now), duration(now - self.start))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
