"""Progress: rates, the time left, and log lines for runs whose stderr is not a terminal."""

from __future__ import annotations

import logging

from graphcal.progress import Progress
from tests.helpers import run_cli


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_time_left_and_periodic_log_lines(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="graphcal")
    with Progress("calibrating", 1000, "sample", bar=False, every=30.0, clock=clock) as p:
        clock.now += 10
        p.update(100)  # 10 samples/s so far; no log line before 30 s
        assert p.rate() == 10.0 and p.left_s() == 90.0
        assert "calibrating: 100/1,000 samples, 10.0 samples/s, about 2 min left" == p.line()
        assert not caplog.records
        clock.now += 30
        p.update(300)  # 400 in 40 s
        clock.now += 560
        p.update(500)  # 900 in 600 s: 1.5/s, 100 left -> 67 s
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["calibrating: 400/1,000 samples, 10.0 samples/s, about 60 s left",
                     "calibrating: 900/1,000 samples, 1.5 samples/s, about 67 s left",
                     "calibrating: 900/1,000 samples, 1.5 samples/s, about 67 s left in 10 min"]


def test_unknown_total_has_no_time_left():
    clock = Clock()
    p = Progress("calibrating", None, "batch", bar=False, clock=clock)
    clock.now += 4
    p.update(2)
    assert p.left_s() is None and p.line() == "calibrating: 2 batches, 0.5 batches/s"
    p.close()


def test_run_and_eval_log_their_progress_with_v(llama_dir, tmp_path):
    result = run_cli("-v", "run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                     "-o", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    # the streamed pass counts layer blocks (docs/streaming.md); the whole-graph pass samples (below)
    assert "calibrating (blocks): 2/2 blocks" in result.output and "blocks/s in" in result.output
    assert "weights: 14/14 weights" in result.output
    whole = run_cli("-v", "run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                    "--pass", "whole-graph", "-o", tmp_path / "whole", "-q")
    assert whole.exit_code == 0, whole.output
    assert "calibrating: 64/64 samples" in whole.output and "samples/s in" in whole.output
    result = run_cli("-v", "eval", llama_dir / "model.onnx", tmp_path / "out" / "model.onnx", "--data",
                     llama_dir / "heldout.npz")
    assert result.exit_code == 0, result.output
    assert "evaluating: 16/16 samples" in result.output
