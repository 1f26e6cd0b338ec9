"""A rank's output as the launcher sees it: its log file read as it grows, echoed, kept for reports."""

from __future__ import annotations

import os
import sys
from collections import deque

_KEEP_LINES = 200  # per rank, for error messages
_ECHO_LIMIT = 2000  # lines per rank echoed to the caller before truncating


class RankOutput:
    """Reads a rank's log file as it grows; echoes complete lines with a rank prefix."""

    def __init__(self, rank: int, path: str, echo: bool):
        self.rank, self.path, self.echo = rank, path, echo
        self.offset = 0
        self.partial = b""
        self.lines: deque[str] = deque(maxlen=_KEEP_LINES)
        self.head: list[str] = []
        self.count = 0

    def pump(self, final: bool = False) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(4 << 20)
                self.offset = fh.tell()
        except FileNotFoundError:
            data = b""
        if not data and not (final and self.partial):
            return
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        if final and self.partial:
            complete.append(self.partial)
            self.partial = b""
        for raw in complete:
            self._line(raw.decode("utf-8", "backslashreplace").rstrip("\r"))
        if final:
            # drain anything left past the 4 MiB read
            while self._more():
                pass

    def _more(self) -> bool:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return False
        if size <= self.offset:
            return False
        self.pump(final=True)
        return True

    def _line(self, line: str) -> None:
        self.count += 1
        self.lines.append(line)
        if len(self.head) < _KEEP_LINES:
            self.head.append(line)
        if self.echo:
            if self.count <= _ECHO_LIMIT:
                sys.stdout.write(f"[rank {self.rank}] {line}\n")
            elif self.count == _ECHO_LIMIT + 1:
                sys.stdout.write(f"[rank {self.rank}] ... (more output hidden; ddp-course shows {_ECHO_LIMIT} lines per rank)\n")

    def text(self) -> str:
        """The output: the first and last lines kept, with a marker for any gap."""
        if self.count <= _KEEP_LINES:
            return "\n".join(self.head)
        rest = self.count - _KEEP_LINES
        tail = list(self.lines)[-min(rest, _KEEP_LINES):]
        skipped = rest - len(tail)
        gap = [f"... ({skipped} lines not kept) ..."] if skipped else []
        return "\n".join(self.head + gap + tail)

    def last(self, n: int = 20) -> list[str]:
        return list(self.lines)[-n:]


