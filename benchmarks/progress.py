"""Progress of a run of items, on stderr by default (standard library only, so anything can reuse it).

On a terminal a status line is rewritten in place while an item runs, and each finished item leaves
one line. Anywhere else (a log file, a pipe) only the finished items' lines are written, as plain
lines: no carriage returns, no escape sequences.

    progress = Progress(total=sum(weights), count=len(items))
    for i, item in enumerate(items, 1):
        progress.begin(i, item.name)
        progress.status("compiling")          # terminal only
        ...
        progress.end(weight, "12.3 us")       # "[i/count 0m07s eta 1m10s] name | 12.3 us"
"""

from __future__ import annotations

import shutil
import sys
import time


def fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    def __init__(self, total: float, count: int, stream=None):
        """``total``: the summed weight of all items (e.g. estimated seconds); ``count``: items."""
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = max(total, 1e-9)
        self.count = count
        self.index = 0
        self.done = 0.0
        self.start = time.perf_counter()
        self.label = ""

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _head(self) -> str:
        elapsed = self.elapsed()
        eta = fmt_duration(elapsed / self.done * (self.total - self.done)) if self.done else "?"
        return f"[{self.index}/{self.count} {fmt_duration(elapsed)} eta {eta}]"

    def begin(self, index: int, label: str) -> None:
        """Item ``index`` (from 1) starts."""
        self.index = index
        self.label = label
        self.status("setup")

    def status(self, text: str) -> None:
        """What the current item is doing; shown on a terminal only."""
        if not self.tty:
            return
        cols = shutil.get_terminal_size((120, 20)).columns
        line = f"{self._head()} {self.label} | {text}"
        self.stream.write("\r\x1b[2K" + line[:cols - 1])
        self.stream.flush()

    def end(self, weight: float, summary: str) -> None:
        """The current item is done: count its weight and leave one line with ``summary``."""
        self.done += weight
        self.line(f"{self._head()} {self.label} | {summary}")

    def line(self, text: str) -> None:
        """A line of its own (on a terminal it replaces the status line)."""
        self.stream.write(("\r\x1b[2K" if self.tty else "") + text + "\n")
        self.stream.flush()
