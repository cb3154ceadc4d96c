"""Child processes whose peak memory is their own, and the commands of the tables' child programs.

Each child runs through ``python -m tools.peak_rss`` (see there why), from the repository root, so that
``python -m tools.<name>`` and ``python -m graphcal`` find this checkout.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.lib import REPO


def child(command: list[str]) -> dict:
    """Run ``command``; its exit code, output, wall time and peak RSS (its own: ru_maxrss through tools.peak_rss)."""
    with tempfile.TemporaryDirectory() as tmp:
        rss, out, err = Path(tmp) / "maxrss", Path(tmp) / "stdout", Path(tmp) / "stderr"
        start = time.perf_counter()
        with out.open("wb") as o, err.open("wb") as e:
            rc = subprocess.run([sys.executable, "-m", "tools.peak_rss", str(rss), *command], stdout=o, stderr=e,
                                cwd=REPO).returncode
        wall = time.perf_counter() - start
        return {"rc": rc, "stdout": out.read_text(errors="replace"), "stderr": err.read_text(errors="replace"),
                "wall_s": wall, "peak_rss_mb": int(rss.read_text()) / 1024 if rss.exists() else None}


def infer_command(model: Path, calib: Path, batch: int, samples: int) -> list[str]:
    """The inference baseline (tools/infer_baseline.py) over the first ``samples`` calibration samples."""
    return [sys.executable, "-m", "tools.infer_baseline", str(model), str(calib), str(batch), str(samples)]


def imports_command() -> list[str]:
    """A child that only imports what a calibration child holds before it calibrates (tools/imports_only.py)."""
    return [sys.executable, "-m", "tools.imports_only"]


def shown(command: list[str]) -> list[str]:
    """``command`` as a reader would type it: ``python -m ...`` without the interpreter's path."""
    return ["python", *command[1:]]
