"""Console output of the loop: plain lines and, on a terminal, a progress bar below them.

When stdout is a terminal (``sys.stdout.isatty()``) and the trainer has no
``logger=``, :class:`~replicator.loop.hooks.LoggingHook` draws a
progress bar on the last line, with the step, the speed and the time left;
otherwise (a file, a pipe, a CI log) there are only the plain lines::

    step 50/200  loss 0.4413  accuracy 0.8125  23.1 ms/step  11083 samples/s
    [##########....................]  50/200  25%  43.3 steps/s  eta 3s  loss 0.4413
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TextIO


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``"loss 0.4413  accuracy 0.8125"``: names and values to 4 significant digits."""
    return "  ".join(f"{name} {value:.4g}" for name, value in metrics.items())


def format_seconds(seconds: float) -> str:
    """A duration as ``"42s"``, ``"3m05s"`` or ``"2h07m"``; ``"?"`` if not finite."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class Console:
    """Lines and, on a terminal, one status line (the progress bar) below them."""

    def __init__(self, stream: TextIO | None):
        self._stream = stream
        self._status = ""

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout  # looked up late: tests swap it

    @property
    def interactive(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def line(self, text: str) -> None:
        status = self._status
        self._clear()
        self.stream.write(text + "\n")
        if status:
            self.status(status)
        else:
            self.stream.flush()

    def status(self, text: str) -> None:
        if not self.interactive:
            return
        pad = max(0, len(self._status) - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._status = text

    def _clear(self) -> None:
        if self._status:
            self.stream.write("\r" + " " * len(self._status) + "\r")
            self._status = ""

    def close(self) -> None:
        """End the status line, leaving the last bar on screen."""
        if self._status:
            self.stream.write("\n")
            self.stream.flush()
            self._status = ""
