"""A small progress indicator for long phases (stderr, redraws in place on a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress("encoding") as p: p.update(done, total)``.

    On a terminal it redraws one line; otherwise it prints at most every few
    seconds so logs stay short.
    """

    def __init__(self, label: str, stream=None, min_interval: float = 0.2):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval = min_interval if self.tty else 5.0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._shown = False

    def __enter__(self) -> "Progress":
        return self

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        now = time.perf_counter()
        if now - self._last < self.min_interval and (total is None or done < total):
            return
        self._last = now
        elapsed = now - self.t0
        if total:
            frac = min(1.0, done / total)
            bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
            text = f"{self.label} [{bar}] {done}/{total} {elapsed:5.1f}s {note}"
        else:
            text = f"{self.label} {done} {elapsed:5.1f}s {note}"
        self._write(text)

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._shown = True

    def __exit__(self, *exc) -> None:
        if self._shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()
