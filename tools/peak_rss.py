"""Child program: run a command and write its peak RSS (ru_maxrss, KiB) to a file; exit with its exit code.

    python -m tools.peak_rss RSS_FILE COMMAND...

Through this small launcher because Linux counts a process's RSS before exec in its ru_maxrss, so a
child forked straight from a table (hundreds of MB once it has run a model) would report at least the
table's size. :func:`tools.lib.children.child` runs every measured child through it.
"""

import os
import sys


def main(argv: list[str]) -> int:
    pid = os.fork()
    if pid == 0:
        os.execv(argv[1], argv[1:])
    _, status, usage = os.wait4(pid, 0)
    with open(argv[0], "w") as f:
        f.write(str(usage.ru_maxrss))
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
