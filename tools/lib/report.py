"""How the tools report: progress lines on stderr, the result printed and written, the CPU's name, table cells."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

START = time.perf_counter()


def log(message: str) -> None:
    """A progress line on stderr, stamped with the seconds since the tool started."""
    print(f"[{time.perf_counter() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


def emit(text: str, results: list[dict], args) -> None:
    """Print the table and notes; write them to ``args.markdown`` and the results to ``args.json`` when given."""
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


def fmt(value, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (and ``suffix``), or ``-`` for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
