"""A run killed without a word (SIGKILL, the kernel's out-of-memory killer) leaves its lock file beside
-o; the next run on that folder says in one line which run that was and the likely cause, then runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.helpers import paused_run, run_cli


def _argv(model_dir, out):
    return ["run", str(model_dir / "model.onnx"), "--data", str(model_dir / "calib.npz"), "-o", str(out), "-q"]


def _stale_lines(text):
    return [line for line in text.splitlines() if "ended without finishing" in line]


def test_a_run_after_a_sigkilled_one_says_so_once_and_succeeds(tmp_path, bert_dir):
    out = tmp_path / "out"
    proc, _go = paused_run(_argv(bert_dir, out), "write", tmp_path)  # calibrated, -o locked, nothing written
    lock = tmp_path / ".out.graphcal-lock"
    record = json.loads(lock.read_text())  # what the lock file says of its holder
    assert record["graphcal"] == proc.pid and record["command"].endswith(f"-o {out} -q")
    assert abs(record["started"] - time.time()) < 600
    proc.kill()  # as the out-of-memory killer does: no handler runs
    proc.communicate()
    assert lock.exists()  # the killed run's lock stays

    result = run_cli(*_argv(bert_dir, out))
    assert result.exit_code == 0, result.output
    (line,) = _stale_lines(result.output)
    assert line.startswith(f"warning: the previous graphcal run on -o {out} (pid {proc.pid}, started ")
    assert "run " + str(bert_dir / "model.onnx") in line  # the command it ran
    assert "out-of-memory killer" in line and "graphcal inspect" in line
    assert "Traceback" not in result.output and not lock.exists()  # the new run's lock went with it
    assert (out / "model.onnx").is_file()


def test_the_line_names_a_reused_pid_and_an_older_lock_but_not_an_empty_one(tmp_path, bert_dir):
    out = tmp_path / "out"
    lock = tmp_path / ".out.graphcal-lock"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)  # a process that has ended
    cases = {
        "older graphcal": (f"graphcal {pid}\n", True),
        "pid reused by this process": (json.dumps({"graphcal": os.getpid(), "started": 1.0e9, "ticks": 1,
                                                    "command": "graphcal run big.onnx"}), True),
        "empty": ("", False),
        "still running": (json.dumps({"graphcal": os.getpid()}), False),  # no start time to tell it from this one
    }
    for name, (text, said) in cases.items():
        lock.write_text(text)
        result = run_cli(*_argv(bert_dir, out))
        assert result.exit_code == 0, (name, result.output)
        lines = _stale_lines(result.output)
        assert len(lines) == int(said), (name, result.output)
        assert not lock.exists(), name
    lock.write_text(json.dumps({"graphcal": os.getpid(), "ticks": 1, "started": 1.0e9,
                                "command": "graphcal run big.onnx"}))
    (line,) = _stale_lines(run_cli(*_argv(bert_dir, out)).output)
    assert f"(pid {os.getpid()}, started " in line and ": graphcal run big.onnx)" in line
