"""Progress and diagnostics: one line to stderr per event, prefixed with the role."""
from __future__ import annotations

import os
import stat
import sys
import threading
from collections import deque
from typing import IO


class _Aside:
    """Lines for `write_aside`'s thread: the newest `most`, and how many older ones were
    dropped before the next one it writes."""

    def __init__(self, most: int):
        self.lines: deque[str] = deque()
        self.most, self.dropped, self.busy = most, 0, False
        self.ready = threading.Condition()


_aside: _Aside | None = None   # (None: a line is written by the thread that says it)
ASIDE_LINES = 1000


def log(role: str, text: str) -> None:
    """`[psgd ROLE] text` to stderr, as `say` writes it: a reader gone (`psgd run ... 2>&1 |
    tee log` after a Ctrl-C ended tee) raised BrokenPipeError from the launcher's stop's
    lines, and the stop was cut short."""
    say(f"[psgd {role}] {text}")


def say(text: str, stream: IO[str] | None = None) -> None:
    """print(text) to `stream` (default stderr), or to nothing where its reader is gone:
    Ctrl-C on `psgd compare ... 2>&1 | tee log` (or `psgd run`) ends tee too, and the line
    that said the command was interrupted raised BrokenPipeError: compare's runs done got
    no report, and each command's exit was 141, not its signal's. The stream is /dev/null
    from then on (a later line, and the exit's flush, would fail again)."""
    aside = _aside
    if stream is None and aside is not None:
        with aside.ready:
            if len(aside.lines) >= aside.most:
                aside.lines.popleft()
                aside.dropped += 1
            aside.lines.append(text)
            aside.ready.notify()
        return
    stream = stream or sys.stderr
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        to_devnull(stream.fileno())


def write_aside(most: int = ASIDE_LINES) -> None:
    """From now on `say` writes this process's lines to stderr from a thread of its own,
    where stderr is not a file (a terminal, a pipe): a coordinator's serve loop was held
    by a reader that stopped reading (a terminal paused with Ctrl-S, `psgd run 2>&1 |
    less` left alone past the pipe's 64 KiB), and the heartbeats it did not answer
    meanwhile had every daemon give it up. The newest `most` lines wait; an older one is
    dropped, and where they were, a line says how many."""
    global _aside
    try:
        if _aside is not None or stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode):
            return
    except (OSError, ValueError, AttributeError):   # (no descriptor: a caller's stream)
        return
    aside = _Aside(most)

    def write() -> None:
        while True:
            with aside.ready:
                aside.busy = False
                aside.ready.notify_all()   # (`flush_aside` waits for this)
                aside.ready.wait_for(lambda: aside.lines)
                text, dropped = aside.lines.popleft(), aside.dropped
                aside.dropped, aside.busy = 0, True
            try:
                if dropped:
                    say(f"[psgd] {dropped} line{'s' * (dropped > 1)} not written here: stderr was not read",
                        sys.stderr)
                say(text, sys.stderr)
            except Exception:   # (a terminal that hung up, EIO: nothing more is said there; the next line tries)
                pass
    threading.Thread(target=write, name="stderr", daemon=True).start()
    _aside = aside


def flush_aside(timeout_s: float = 2.0) -> None:
    """Wait up to `timeout_s` for `write_aside`'s lines to be written (a process's end:
    those still waiting then are not)."""
    aside = _aside
    if aside is not None:
        with aside.ready:
            aside.ready.wait_for(lambda: not aside.lines and not aside.busy, timeout_s)


def to_devnull(fd: int) -> None:
    """Point file descriptor `fd`, whose reader is gone (a closed pipe, a terminal that
    hung up), at /dev/null: later writes, and the exit's flush, do not fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
