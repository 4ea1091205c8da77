"""A one-line progress bar: step, loss, tokens/s and the measured bubble.

On a terminal the line is redrawn in place; otherwise (a log file, a test) it is printed
about ten times over the run, so logs stay short.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Progress"]

_BAR = 24


class Progress:
    """Draws ``update(step, loss, tokens_per_s, bubble)`` for ``total`` steps on ``stream``."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._every = max(1, total // 10)

    def line(self, step: int, loss: float, tokens_per_s: float, bubble: float) -> str:
        done = round(_BAR * step / self.total) if self.total else _BAR
        bar = "#" * done + "." * (_BAR - done)
        width = len(str(self.total))
        return (
            f"[{bar}] step {step:>{width}}/{self.total}  loss {loss:6.3f}  "
            f"{tokens_per_s:8,.0f} tok/s  bubble {100 * bubble:4.1f}%"
        )

    def update(self, step: int, loss: float, tokens_per_s: float, bubble: float) -> None:
        """Show the state after ``step`` (1-based) steps."""
        text = self.line(step, loss, tokens_per_s, bubble)
        if self.live:
            self.stream.write("\r" + text)
            if step == self.total:
                self.stream.write("\n")
        elif step == 1 or step == self.total or step % self._every == 0:
            self.stream.write(text + "\n")
        self.stream.flush()
