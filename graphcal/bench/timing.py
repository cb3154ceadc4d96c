"""Interleaved timing: two models timed in alternating rounds, the order flipped every round, so drift hits both alike."""

from __future__ import annotations

import math
import time

from graphcal.errors import first_line

MIN_SAMPLE_S = 0.02  # a timed sample averages as many calls as make it last this long
MAX_CALLS = 1000  # ... but never more calls than this per sample


class RunFailed(Exception):
    def __init__(self, index: int, detail: str):
        super().__init__(detail)
        self.index, self.detail = index, detail


def round_order(count: int, rounds: int):
    """For each of ``rounds`` rounds, the order in which ``count`` runs take their turn: 0, 1, ...
    in even rounds, reversed in odd ones, so that drift falls on every run alike."""
    order = list(range(count))
    for r in range(rounds):
        yield order if r % 2 == 0 else order[::-1]


def time_interleaved(runs, warmup: int, rounds: int) -> tuple[list[list[float]], list[int]]:
    """Per run: ``rounds`` samples of seconds per call, and the calls averaged in each sample.

    ``warmup`` untimed calls of each first; then one call of each, timed, picks how many calls
    make a sample of at least MIN_SAMPLE_S. Each round times every run once, the order reversed
    every other round."""
    def call(i: int) -> None:
        try:
            runs[i]()
        except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own types from a kernel
            raise RunFailed(i, first_line(e).removeprefix("Error in execution: ")) from None

    for _ in range(warmup):
        for i in range(len(runs)):
            call(i)
    calls = []
    for i in range(len(runs)):
        start = time.perf_counter()
        call(i)
        once = max(time.perf_counter() - start, 1e-9)
        calls.append(int(min(MAX_CALLS, max(1, math.ceil(MIN_SAMPLE_S / once)))))
    samples: list[list[float]] = [[] for _ in runs]
    for order in round_order(len(runs), rounds):
        for i in order:
            start = time.perf_counter()
            for _ in range(calls[i]):
                call(i)
            samples[i].append((time.perf_counter() - start) / calls[i])
    return samples, calls
